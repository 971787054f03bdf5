"""vLLM 0.33.0's own CUDA attention-backend selection, run on a CPU for any GPU.

Import it only in a process of its own (``vllm_harness`` runs it in a spawned worker):
what it stands in for below would change how the rest of vLLM behaves on the CPU.

``vllm/platforms/cuda.py`` holds the priority lists per compute capability
(``_get_backend_priorities``) and the selection (``CudaPlatformBase.get_valid_backends``:
each candidate's ``validate_configuration``, the first valid one wins). Neither it nor
several backends import without a CUDA driver, and several backends check that their
compiled kernels loaded. None of that is selection logic: the wheel ships every one of
those libraries, they just cannot be loaded without ``libcuda.so.1``. So, and only so,
this module stands in for them as vLLM's CUDA image has them:

* the wheel's CUDA extension modules (``_C_stable_libtorch``, ``_flashmla_C``, the
  FlashAttention 2/3 builds, ...) are empty modules: loaded, as they would be;
* ``fa_utils`` binds FlashAttention's entry points from ``vllm.vllm_flash_attn`` as it
  does when the platform is CUDA, and FlashMLA's availability flags are what its import
  sets there (``current_platform`` is the CPU's, so module-level CUDA branches are off);
* ``cutlass_mla`` allocates its workspace on the meta device and counts a B200's SMs
  while it loads;
* ``current_platform`` says it is CUDA and reports the planned GPU's capability while
  vLLM selects (some backends ask it rather than their argument), inside a default
  vLLM config;
* FlashInfer counts as usable (``VLLM_HAS_FLASHINFER_CUBIN``: the CUDA image ships
  flashinfer-cubin).

Everything that decides (priority lists, each backend's head sizes, dtypes, KV formats,
sinks, sparse, block sizes, capabilities, FlashAttention's version choice) is vLLM's own.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_HAS_FLASHINFER_CUBIN", "1")

#: compiled libraries of the vLLM 0.33.0 wheel that need ``libcuda.so.1`` to load
CUDA_EXTENSIONS = (
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm._qutlass_C",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
)
for _name in CUDA_EXTENSIONS:
    sys.modules.setdefault(_name, types.ModuleType(_name))

import torch  # noqa: E402
import vllm.platforms.cuda as _cuda  # noqa: E402
import vllm.vllm_flash_attn as _fa  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends import fa_utils  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.ops import flashmla  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

__all__ = [
    "AttentionSelectorConfig",
    "DeviceCapability",
    "Selection",
    "backend_class",
    "on_capability",
    "priorities",
    "select",
]


@contextlib.contextmanager
def _cuda_allocations_on_meta() -> Iterator[None]:
    from vllm.utils import platform_utils

    real_empty, real_units = torch.empty, platform_utils.num_compute_units

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "meta"
        return real_empty(*args, **kwargs)

    torch.empty = empty  # type: ignore[assignment]
    platform_utils.num_compute_units = lambda device_id=0: 148  # a B200's SMs
    try:
        yield
    finally:
        torch.empty = real_empty  # type: ignore[assignment]
        platform_utils.num_compute_units = real_units


def _as_on_the_cuda_image() -> None:
    from vllm import _custom_ops

    fa_utils.reshape_and_cache_flash = _custom_ops.reshape_and_cache_flash  # type: ignore
    for name in ("flash_attn_varlen_func", "get_scheduler_metadata",
                 "compile_flash_attn_varlen_func_from_specs"):
        setattr(fa_utils, name, getattr(_fa, name))
    flashmla._flashmla_C_AVAILABLE = True
    flashmla._flashmla_extension_C_AVAILABLE = True
    with _cuda_allocations_on_meta():
        importlib.import_module("vllm.v1.attention.backends.mla.cutlass_mla")


_as_on_the_cuda_image()


def _import_backends_as_on_cuda() -> None:
    """Backend modules bind some names only when the platform is CUDA at import (e.g.
    FlashAttention's sinks check): import every CUDA candidate under the CUDA platform."""
    with on_capability((9, 0)):
        for backend in AttentionBackendEnum:
            with contextlib.suppress(Exception):
                backend.get_class()




@contextlib.contextmanager
def on_capability(capability: tuple[int, int]) -> Iterator[None]:
    """``current_platform`` reports ``capability`` (some backends ask it rather than the
    selector's argument: FlashInfer's sinks and KV layouts go by TRT-LLM's kernels), inside
    a vLLM config as at start-up (FlashInfer reads ``attention_config``)."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.utils import flashinfer

    platform = type(current_platform)
    saved = {n: platform.__dict__.get(n) for n in ("get_device_capability", "is_cuda")}
    platform.get_device_capability = classmethod(  # type: ignore[method-assign]
        lambda cls, device_id=0: DeviceCapability(*capability)
    )
    platform.is_cuda = lambda self: True  # type: ignore[method-assign]
    flashinfer.supports_trtllm_attention.cache_clear()  # cached per process, not per GPU
    try:
        if get_current_vllm_config_or_none() is None:
            with set_current_vllm_config(VllmConfig()):
                yield
        else:
            yield
    finally:
        for name, real in saved.items():
            if real is None:
                delattr(platform, name)
            else:
                setattr(platform, name, real)
        flashinfer.supports_trtllm_attention.cache_clear()


_import_backends_as_on_cuda()


class Selection(types.SimpleNamespace):
    """What vLLM picked: ``name``, its ``cls``, and why each higher one was passed over."""

    name: str
    cls: Any
    passed_over: dict[str, list[str]]


def select(capability: tuple[int, int], config: AttentionSelectorConfig,
           num_heads: int | None = None) -> Selection:
    """``CudaPlatform.get_attn_backend_cls`` with no --attention-backend, on ``capability``.

    Raises ``ValueError`` with vLLM's own "No valid attention backend found" message."""
    cap = DeviceCapability(*capability)
    with on_capability(capability):
        valid, invalid = _cuda.CudaPlatformBase.get_valid_backends(
            device_capability=cap, attn_selector_config=config, num_heads=num_heads
        )
    if not valid:
        reasons = ", ".join(f"{b.name}: {r}" for b, (_, r) in invalid.items())
        raise ValueError(f"No valid attention backend found: {reasons}")
    best = min(valid, key=lambda c: c.priority)
    passed = {b.name: r for b, (p, r) in invalid.items() if p < best.priority}
    return Selection(name=best.backend.name, cls=best.backend_class, passed_over=passed)


def select_names(capability: tuple[int, int], asked: list[tuple[Any, Any]]) -> list[str]:
    """``select`` for each (selector config, heads), as names; a refusal as its text."""
    names = []
    for config, heads in asked:
        try:
            names.append(select(capability, config, heads).name)
        except ValueError as refusal:
            names.append(f"refused: {refusal}")
    return names


def gdn_prefill_kernel(capability: tuple[int, int], head_k_dim: int, head_v_dim: int,
                       cuda_major: int = 13) -> str:
    """vLLM's ``_resolve_gdn_prefill_backend`` on ``capability`` with a CUDA ``cuda_major``
    runtime (it reads only the GDN head widths and ``additional_config``)."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.platforms import current_platform

    text = types.SimpleNamespace(linear_key_head_dim=head_k_dim, linear_value_head_dim=head_v_dim)
    vc = types.SimpleNamespace(
        additional_config={}, model_config=types.SimpleNamespace(hf_text_config=text)
    )
    platform = type(current_platform)
    saved = platform.__dict__.get("get_cuda_runtime_major")
    platform.get_cuda_runtime_major = classmethod(lambda cls: cuda_major)  # type: ignore
    try:
        with on_capability(capability):
            return gdn._resolve_gdn_prefill_backend(vc)[1]
    finally:
        if saved is None:
            delattr(platform, "get_cuda_runtime_major")
        else:
            platform.get_cuda_runtime_major = saved  # type: ignore[method-assign]


def priorities(capability: tuple[int, int], **kwargs: Any) -> list[str]:
    """``_get_backend_priorities`` as names."""
    return [b.name for b in _cuda._get_backend_priorities(
        device_capability=DeviceCapability(*capability), **kwargs)]


def backend_class(name: str) -> Any:
    return AttentionBackendEnum[name].get_class()
