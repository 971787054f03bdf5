"""An emulated GPU for vLLM 0.33.0: the whole engine on a CPU, no weights, no forward pass.

``SPILLWAY_EMULATE_GPU=1`` makes Spillway's platform plug-in (entry point
``vllm.platform_plugins`` -> :func:`.plugin.platform_plugin`) hand vLLM
:class:`~spillway_engine.emulator.platform.EmulatedGpuPlatform`, whose worker
(:class:`~spillway_engine.emulator.worker.EmulatedGpuWorker`) builds the real model on
the meta device with the plan's attention backend, reports an emulated memory budget,
keeps the KV caches in CPU tensors and answers each step with tokens derived from the
KV bytes it reads. vLLM's API server, engine core, scheduler, KV-cache manager, prefix
cache, metrics, Spillway's connector (both sides) and the start-up plan check all run
for real.

The plug-in is loaded in every vLLM process, so it is inert (returns None) unless
emulation is asked for.
"""

from __future__ import annotations

import os

#: Set (to anything but "", "0", "false") to run vLLM on the emulated GPU.
ENV_EMULATE = "SPILLWAY_EMULATE_GPU"
#: Bytes of emulated GPU memory left for the KV cache (default 256 MiB).
ENV_KV_BYTES = "SPILLWAY_EMULATE_KV_BYTES"
#: Attention backend / GPU name when no plan is given (SPILLWAY_PLAN names the plan).
ENV_BACKEND = "SPILLWAY_EMULATE_ATTENTION_BACKEND"
ENV_GPU = "SPILLWAY_EMULATE_GPU_NAME"
#: Time factor for the modelled step time (:mod:`.latency`): 1.0 real time, 2.0 twice
#: as slow, 0 or unset = never sleep (steps take as long as the emulator's own work).
ENV_SPEED = "SPILLWAY_EMULATE_SPEED"
#: Parameter count to time the steps by (e.g. ``8e9``), instead of the count of the
#: served model's own parameters (a tiny test model then times like an 8B one).
ENV_MODEL_PARAMS = "SPILLWAY_EMULATE_MODEL_PARAMS"

#: KV budget when neither SPILLWAY_EMULATE_KV_BYTES nor the launcher gives one.
DEFAULT_KV_BYTES = 256 << 20

#: The ``vllm.platform_plugins`` entry point's name (pyproject.toml): a VLLM_PLUGINS
#: allow-list must name it for the emulated platform to load.
PLATFORM_PLUGIN_NAME = "spillway_emulator"

PLATFORM_QUALNAME = "spillway_engine.emulator.platform.EmulatedGpuPlatform"
WORKER_QUALNAME = "spillway_engine.emulator.worker.EmulatedGpuWorker"
#: The executor that keeps the worker inside the engine-core process.
EXECUTOR_QUALNAME = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def emulation_requested(env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENV_EMULATE, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def emulator_env(
    kv_bytes: int | None = None, speed: float | None = None, model_params: float | None = None
) -> dict[str, str]:
    """Environment additions that make ``vllm serve`` run on the emulated GPU."""
    env = {ENV_EMULATE: "1"}
    if kv_bytes is not None:
        env[ENV_KV_BYTES] = str(int(kv_bytes))
    if speed is not None:
        env[ENV_SPEED] = repr(float(speed))
    if model_params is not None:
        env[ENV_MODEL_PARAMS] = repr(float(model_params))
    return env


def emulator_args() -> list[str]:
    """Extra ``vllm serve`` arguments for the emulated GPU (the platform also sets
    the worker class; naming it keeps the command self-describing)."""
    return ["--worker-cls", WORKER_QUALNAME]
