"""Where a stand-in for the GPU plugs into the offloader.

The offloader is part of the flow (planner -> offloader -> launcher) and never imports
the emulator, which stands beside it. When vLLM runs on the emulated GPU, the emulator's
platform plug-in (called in every vLLM process before the platform is used) fills these
in: the modelled host <-> GPU link the worker times its copies by, and the counters only
an emulated GPU exports. Unset, the offloader runs as on a real GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from spillway_engine.metrics import Metric

#: Returns the link model (seconds for n bytes) or None (copies finish at once).
host_link: Callable[[], Callable[[int], float] | None] | None = None
#: Counters the stand-in increments through the offloading worker's stats.
counters: tuple[Metric, ...] = ()


def install(link: Callable[[], Callable[[int], float] | None],
            extra_counters: tuple[Metric, ...]) -> None:
    global host_link, counters
    host_link, counters = link, extra_counters


def link_seconds() -> Callable[[int], float] | None:
    """The installed link model, if a stand-in installed one."""
    return host_link() if host_link is not None else None
