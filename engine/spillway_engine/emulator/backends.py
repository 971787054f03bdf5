"""The planned GPU's attention choices, applied to vLLM 0.33.0's layers on a CPU.

Shared by the emulated GPU worker (:mod:`.worker`) and the contract harness
(``tests/contract/vllm_harness.py``): both build the real model class on the meta
device and must make vLLM compute the KV-cache specs the planned GPU would get. The
kernels decide block sizes and spec tweaks, so every attention layer is given the
class of the backend the plan names (``plan.gpu.attention_backend``), or a class
that imports on a CPU and has the same block rule; GDN layers get the checkpoint
grid the planned GPU's prefill kernel uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
    FlashInferMLASparseTRTLLMBackend,
)
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode
from vllm.v1.worker.utils import customize_attention_spec

#: The backend vLLM 0.33 picks on a GPU the planner does not name (its default).
DEFAULT_BACKEND = "FLASH_ATTN"
MLA_BACKENDS = (
    "FLASH_ATTN_MLA",
    "FLASHINFER_MLA",
    "TRITON_MLA",
    "FLASHMLA",
    "FLASH_ATTN_MLA_SPARSE",
    "FLASHMLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM90",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASH_ATTN_MLA_SPARSE_FA4",
)
#: Backends a model's own attention classes choose (DeepSeek-V4's layers report their
#: class's ``backend_cls``, CUDA's and the CPU variant's with the same kernel pages and
#: layouts): the layers keep them, as the planner's contract test builds them.
MODEL_DRIVEN_BACKENDS = ("FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4")
#: GPUs whose FlashAttention is FA3/FA4 on SM90 (the head-512 FP8 page rule below)
_SM90_GPUS = ("h100", "h200", "h20")


class FlashAttentionSm90StandIn(FlashAttentionBackend):
    """FlashAttention's kernel block rule as on SM90, on a class that imports on a CPU.

    On Hopper ``get_flash_attn_version(head_size=512)`` upgrades FA3 to FA4 (FA3 stops at
    head 256), and FA4's SM90 FP8-dequant kernel runs exactly 64-token pages
    (``_get_sm90_fa4_fp8_kv_block_size``); the CPU's capability check turns that off.
    Every other spec keeps the class's own rule.
    """

    @staticmethod
    def _get_sm90_fa4_fp8_kv_block_size(kv_cache_spec: Any = None) -> int | None:
        if kv_cache_spec is None:
            vllm_config = get_current_vllm_config_or_none()
            if vllm_config is None or vllm_config.model_config is None:
                return None
            head_size = vllm_config.model_config.get_head_size()
            fp8 = vllm_config.cache_config.cache_dtype in ("fp8", "fp8_e4m3")
        else:
            if not isinstance(kv_cache_spec, AttentionSpec):
                return None
            head_size = kv_cache_spec.head_size
            fp8 = kv_cache_spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
        return 64 if fp8 and head_size == 512 else None


def _kernel_pages(base: type, name: str, sizes: list[int], doc: str) -> type:
    """A stand-in for backend ``name``: ``base``'s class (it constructs on a CPU, and the
    emulated worker allocates its cache layout) with the kernel pages of ``name``, whatever
    GPU is emulated. As in vLLM's ``AttentionBackend``, a block is accepted when it is a
    multiple of the smallest page, and the preferred block is the default (16) when
    accepted, else that smallest page."""
    step = min(sizes)

    def accepts(cls: type, block_size: int | None) -> bool:
        return block_size is None or block_size % step == 0

    def preferred(cls: type, default_block_size: int) -> int:
        return default_block_size if default_block_size % step == 0 else step

    return type(f"{name.title().replace('_', '')}StandIn", (base,), {
        "__doc__": doc,
        "__module__": __name__,
        "get_supported_kernel_block_sizes": staticmethod(lambda kv_cache_spec=None: list(sizes)),
        "supports_block_size": classmethod(accepts),
        "get_preferred_block_size": classmethod(preferred),
        "get_name": staticmethod(lambda: name),
    })


FlashMLAStandIn = _kernel_pages(
    TritonMLABackend, "FLASHMLA", [64],
    "FlashMLA's exactly-64-token pages: the real backend asserts its CUDA extension at "
    "construction; only its block sizes matter to the KV plan (it has no customize_spec).",
)
FlashInferMLAStandIn = _kernel_pages(
    TritonMLABackend, "FLASHINFER_MLA", [32, 64],
    "FlashInfer MLA's 32 or 64-token pages (16 refused, 32 preferred); its TRT-LLM kernels "
    "are SM10x only.",
)
#: FlashAttention's own class is no stand-in for FlashInfer on an emulated SM10x: there it
#: asks for FA4's 128-token pages at head 256, a rule of FA4's, not FlashInfer's
FlashInferStandIn = _kernel_pages(
    FlashAttentionBackend, "FLASHINFER", [16, 32, 64], "FlashInfer's 16, 32 or 64-token pages."
)
TritonFlashInferStandIn = _kernel_pages(
    FlashAttentionBackend, "TRITON_FLASHINFER", [64],
    "The Triton+FlashInfer prefix-LM composite's exactly-64-token pages (SM10x).",
)


class FlashAttnMLASparseFA4StandIn(FlashInferMLASparseTRTLLMBackend):
    """FA4's sparse MLA (SM10x; its module needs CUDA to import): the FlashInfer TRT-LLM
    sparse class it extends, with its MultipleOf(64) pages (64-row block strides)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(64)]

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN_MLA_SPARSE_FA4"


# The planner's backend names -> the vLLM class whose kernel block rule stands in for
# it on a CPU (FlashAttention-MLA needs CUDA to import; Triton-MLA shares its
# MultipleOf(16) rule; Triton and FlashAttention share MultipleOf(16)).
_BACKENDS = {
    "FLASH_ATTN": AttentionBackendEnum.FLASH_ATTN,
    "TRITON_FLASH_ATTN": AttentionBackendEnum.FLASH_ATTN,
    # vLLM forces Triton attention for Gemma 4 off Hopper: the same MultipleOf(16) rule
    "TRITON_ATTN": AttentionBackendEnum.FLASH_ATTN,
    "FLASH_ATTN_MLA": AttentionBackendEnum.TRITON_MLA,
    "TRITON_MLA": AttentionBackendEnum.TRITON_MLA,
}
BACKEND_PATHS: Mapping[str, str] = {
    **{name: backend.get_path() for name, backend in _BACKENDS.items()},
    "FLASHMLA": f"{__name__}.FlashMLAStandIn",
    "FLASHINFER_MLA": f"{__name__}.FlashInferMLAStandIn",
    "FLASHINFER": f"{__name__}.FlashInferStandIn",
    "TRITON_FLASHINFER": f"{__name__}.TritonFlashInferStandIn",
    # Sparse MLA: FlashMLA's sparse backend imports on a CPU (FlashAttention's needs
    # CUDA); both run MultipleOf(64) blocks and align 16-bit blocks to whole rows.
    "FLASHMLA_SPARSE": AttentionBackendEnum.FLASHMLA_SPARSE.get_path(),
    "FLASH_ATTN_MLA_SPARSE": AttentionBackendEnum.FLASHMLA_SPARSE.get_path(),
    # FlashInfer's SM90 sparse MLA imports on a CPU: its own class (plain fp8 rows)
    "FLASHINFER_MLA_SPARSE_SM90": AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM90.get_path(),
    # Blackwell's sparse MLA: FlashInfer's TRT-LLM (SM10x) and SM120 classes import on a
    # CPU; FA4's stands in on the TRT-LLM class it extends
    "FLASHINFER_MLA_SPARSE": AttentionBackendEnum.FLASHINFER_MLA_SPARSE.get_path(),
    "FLASHINFER_MLA_SPARSE_SM120": AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120.get_path(),
    "FLASH_ATTN_MLA_SPARSE_FA4": f"{__name__}.FlashAttnMLASparseFA4StandIn",
}


def backend_path(attention_backend: str | None) -> str:
    """Qualified name of the class standing in for the planned backend."""
    name = attention_backend or DEFAULT_BACKEND
    try:
        return BACKEND_PATHS[name]
    except KeyError:
        raise ValueError(
            f"no CPU stand-in for attention backend {name!r} (known: {sorted(BACKEND_PATHS)})"
        ) from None


def construct_backend_path(
    attention_backend: str | None, kv_cache_dtype: str, has_sink: bool = False
) -> str | None:
    """The backend class the layers must be *constructed* with, or None for any.

    MLA layers need an MLA backend at construction. FlashAttention's impl needs CUDA
    for an FP8 KV cache and for attention sinks (gpt-oss): vLLM 0.33.0 imports
    ``flash_attn_supports_sinks`` only where its CUDA FlashAttention kernels load, so
    on a CPU ``FlashAttentionImpl`` with sinks raises ``NameError``. Triton has the
    same 16-token rule and constructs with both; the layers are then given the plan's
    backend (:func:`give_planned_backends`) before any block size or spec is read.
    """
    if attention_backend in MLA_BACKENDS:
        return BACKEND_PATHS[attention_backend]
    if kv_cache_dtype != "auto" or has_sink:
        return AttentionBackendEnum.TRITON_ATTN.get_path()
    return None


def give_planned_backends(
    layers: Mapping[str, Any],
    attention_backend: str | None,
    gpu: str,
    enable_prefix_caching: bool,
    gdn_prefill_kernel: str | None,
) -> None:
    """Tell each built layer it runs the planned GPU's kernels (block rules, grids)."""
    if attention_backend in MODEL_DRIVEN_BACKENDS:
        return
    cls = resolve_obj_by_qualname(backend_path(attention_backend))
    if cls is FlashAttentionBackend and gpu in _SM90_GPUS:
        cls = FlashAttentionSm90StandIn  # FA4's 64-token FP8 pages at head 512
    for layer in layers.values():
        backend = layer.get_attn_backend()
        if backend.is_ssm():
            if (
                gdn_prefill_kernel == "flashinfer"
                and enable_prefix_caching
                and hasattr(layer, "_checkpoint_alignment")
            ):
                layer._checkpoint_alignment = 64  # FlashInfer's GDN prefill (SM90, SM10x/12x)
            continue
        layer.attn_backend = cls


def layer_kv_cache_specs(vllm_config: Any, layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers' KV-cache specs, by the GPU model runner's rule
    (``GPUModelRunner.get_kv_cache_spec``: KV-sharing layers and layers without a
    cache skipped, attention specs customised by their backend)."""
    specs: dict[str, Any] = {}
    for name, layer in layers.items():
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        if isinstance(spec, AttentionSpec) and not isinstance(layer, MambaBase):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        specs[name] = spec
    return specs
