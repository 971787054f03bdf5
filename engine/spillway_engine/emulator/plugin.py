"""The emulator's ``vllm.platform_plugins`` entry point (pyproject.toml).

vLLM calls :func:`platform_plugin` in every process before the platform is used. Unless
emulation is asked for it returns None and vLLM picks its own platform; when it is, it
names the emulated platform and plugs the emulator's link model and page-check counter
into the offloader (:mod:`spillway_engine.offloader.stand_in`), which never imports the
emulator. Its own module, so that the package's names import nothing of the emulator.
"""

from __future__ import annotations

from collections.abc import Callable

from spillway_engine.emulator import PLATFORM_QUALNAME, emulation_requested


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry: the emulated platform, only when asked for."""
    if not emulation_requested():
        return None
    from spillway_engine.metrics import EMULATOR_KV_MISMATCH
    from spillway_engine.offloader import stand_in

    stand_in.install(_modelled_host_link, (EMULATOR_KV_MISMATCH,))
    return PLATFORM_QUALNAME


def _modelled_host_link() -> Callable[[int], float] | None:
    # imported when a worker asks: the platform module is heavy (torch, vLLM)
    from spillway_engine.emulator.platform import modelled_host_link

    return modelled_host_link()
