"""``EmulatedGpuPlatform``: vLLM's view of the planned GPU, with CPU tensors underneath.

Why a platform and not ``VLLM_TARGET_DEVICE=cpu``: ``CpuPlatform`` makes choices the
GPU does not (128-token blocks for its own backend, MLA forced to 16-token blocks with
prefix caching and chunked prefill off, the SSM cache dtype reset to float32, the
``mp`` executor, libgomp preloads) and its worker needs the ``_C`` CPU kernels the
CUDA wheel lacks. This platform keeps the base ``Platform`` rules (those ``CudaPlatform``
uses for block sizes), answers the attention-backend question with the plan's backend,
and only switches off what needs a real device (CUDA graphs, compilation, async
scheduling, pinned memory).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

from spillway_engine.emulator import (
    DEFAULT_KV_BYTES,
    ENV_BACKEND,
    ENV_GPU,
    ENV_KV_BYTES,
    ENV_SPEED,
    EXECUTOR_QUALNAME,
    WORKER_QUALNAME,
)
from spillway_engine.launcher.plugin import ENV_PLAN, load_plan_file

logger = init_logger(__name__)

#: Memory reported as the device's total: the KV budget plus room vLLM never sees used.
_DEVICE_OVERHEAD_BYTES = 1 << 30


@cache
def planned_gpu() -> dict[str, Any]:
    """The GPU facts the plan records (``SPILLWAY_PLAN``), or the env fallbacks.

    The plan is read as the plugin reads it (the planner's one reader, which imports
    no vLLM, so it is safe while vLLM resolves its platform); the launcher has
    already refused a bad plan.
    """
    facts: dict[str, Any] = {
        "name": os.environ.get(ENV_GPU, "h100"),
        "product": None,
        "compute_capability": "9.0",
        "attention_backend": os.environ.get(ENV_BACKEND) or None,
        "enable_prefix_caching": True,
        "gdn_prefill_kernel": None,
    }
    path = os.environ.get(ENV_PLAN)
    if path:
        plan = load_plan_file(path)
        facts.update(
            name=plan.gpu.name,
            product=plan.gpu.product,
            compute_capability=plan.gpu.compute_capability,
            attention_backend=plan.gpu.attention_backend or facts["attention_backend"],
            enable_prefix_caching=plan.enable_prefix_caching,
            gdn_prefill_kernel=plan.gpu.gdn_prefill_kernel,
        )
    if os.environ.get(ENV_BACKEND):
        facts["attention_backend"] = os.environ[ENV_BACKEND]
    return facts


def kv_budget_bytes() -> int:
    """Emulated GPU memory left for the KV cache after weights and activations."""
    return int(os.environ.get(ENV_KV_BYTES) or DEFAULT_KV_BYTES)


class EmulatedGpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    ray_device_key: str = ""
    device_control_env_var: str = "SPILLWAY_EMULATED_VISIBLE_DEVICES"
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        gpu = planned_gpu()
        return f"emulated {gpu['product'] or gpu['name']}"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        major, _, minor = str(planned_gpu()["compute_capability"]).partition(".")
        return DeviceCapability(int(major), int(minor or 0))

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        # Kernel set-up code asks for it (Triton MLA's split count); only its size
        # matters: the planned GPU's SMs (132 on H100/H200 SXM; 108 on A100).
        # SMs of each catalogue GPU (its datasheet); others count as an H100's
        return {"a100": 108, "a100-40gb": 108, "l40s": 142, "l4": 58, "h20": 78,
                "b200": 148, "gb200": 152, "b300": 160, "gb300": 160,
                "rtx-pro-6000": 188}.get(planned_gpu()["name"], 132)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return kv_budget_bytes() + _DEVICE_OVERHEAD_BYTES

    @classmethod
    def get_current_memory_usage(cls, device: Any = None) -> float:
        return 0.0

    @classmethod
    def inference_mode(cls) -> Any:
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass  # one emulated device per process

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        pass

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        pass  # no forward pass: the CUDA wheel's kernels are never needed

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True  # as on CUDA: hybrid models keep their KV-cache groups

    @classmethod
    def supports_fp8(cls) -> bool:
        capability = cls.get_device_capability()
        return capability is not None and capability >= (8, 9)  # Ada and Hopper

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        # The layers are built with a class that constructs on a CPU; the worker then
        # gives each layer the plan's backend (emulator.backends) before vLLM reads
        # block sizes and specs from it.
        from spillway_engine.emulator.backends import backend_path, construct_backend_path

        gpu = planned_gpu()
        dtype = str(getattr(attn_selector_config, "kv_cache_dtype", None) or "auto")
        sink = bool(getattr(attn_selector_config, "has_sink", False))
        return construct_backend_path(gpu["attention_backend"], dtype, sink) or backend_path(
            gpu["attention_backend"]
        )

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config: Any) -> Any:
        # A GPU's MLA prefill kernels (FlashAttention, FlashInfer) do not import on a
        # CPU. The prefill backend only computes; the KV layout comes from the decode
        # backend, which stays the plan's. vLLM's own CPU prefill class constructs here.
        from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

        return MLAPrefillBackendEnum.CPU.get_class()

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_QUALNAME
        if parallel.world_size == 1 and parallel.distributed_executor_backend in (None, "uni"):
            parallel.distributed_executor_backend = EXECUTOR_QUALNAME
        # The worker answers each step from execute_model; nothing to overlap.
        vllm_config.scheduler_config.async_scheduling = False
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True


def modelled_host_link() -> Any:
    """Seconds a host <-> GPU transfer of n bytes takes on the planned GPU's link, times
    ``SPILLWAY_EMULATE_SPEED``; None at speed 0 (transfers finish at once)."""
    from spillway_engine.emulator.latency import gpu_profile, parse_speed, transfer_s

    speed = parse_speed(os.environ.get(ENV_SPEED))
    if speed <= 0:
        return None
    gpu = gpu_profile(planned_gpu()["name"])
    return lambda nbytes: transfer_s(nbytes, gpu) * speed
