"""Sparse MLA (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5, GLM-5 Next): which
kernel vLLM 0.33.0 runs the latents on, in which cache format, on each GPU.

vLLM asks its CUDA selector with ``use_sparse`` and the heads on one rank
(``MLAAttention``: ``num_heads``); the dense MLA backends at the head of each list
refuse sparse, so the sparse tail of ``_get_backend_priorities`` decides:

* SM90: FLASH_ATTN_MLA_SPARSE, FLASHMLA_SPARSE, then FLASHINFER_MLA_SPARSE_SM90 (first
  instead when the latent is 512 wide);
* SM10x: with a quantized cache FLASHINFER_MLA_SPARSE, FLASHMLA_SPARSE; with a 16-bit one
  FLASH_ATTN_MLA_SPARSE_FA4, FLASHINFER_MLA_SPARSE, FLASHMLA_SPARSE at <= 16 heads a rank,
  else FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE;
* SM12x: FLASHINFER_MLA_SPARSE_SM120 only; SM8x: none (vLLM stops).

The first backend whose ``validate_configuration`` takes the model wins. Then
``_canonicalize_sparse_mla_kv_cache_dtype`` may change the cache format (FlashMLA stores
every quantized cache as fp8_ds_mla, the SM120 kernel every auto/fp8 one), which sets
the bytes of a latent (``MLAAttention.get_kv_cache_spec``: 656 B for fp8_ds_mla); the
backend's ``customize_spec`` makes blocks whole kernel pages of rows apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway_engine.planner.gpus import (
    FLASH_ATTN_MLA_SPARSE,
    FLASHINFER_MLA_SPARSE_SM90,
    FLASHMLA_SPARSE,
    FP8_DS_MLA_BYTES_PER_TOKEN,
    Backend,
    Gpu,
    KernelBlocks,
)
from spillway_engine.planner.shape import DTYPE_BYTES, ModelShape, UnsupportedModel

#: FA4's sparse MLA decode beside FlashInfer's prefill (SM10x, 16-bit caches only)
FLASH_ATTN_MLA_SPARSE_FA4 = Backend("FLASH_ATTN_MLA_SPARSE_FA4", KernelBlocks(64))
#: FlashInfer's TRT-LLM sparse MLA (SM10x): plain 16-bit or per-tensor fp8 rows
FLASHINFER_MLA_SPARSE = Backend("FLASHINFER_MLA_SPARSE", KernelBlocks(32))
#: FlashInfer's SM120 sparse MLA: fp8_ds_mla rows whatever auto/fp8 says
FLASHINFER_MLA_SPARSE_SM120 = Backend("FLASHINFER_MLA_SPARSE_SM120", KernelBlocks(64))

#: rows a kernel page holds, which blocks must be whole multiples of apart
#: (``align_blocks_to_rows(spec, rows)`` in each backend's ``customize_spec``)
_PAGE_ROWS = {
    FLASHINFER_MLA_SPARSE.name: 32,
    FLASH_ATTN_MLA_SPARSE_FA4.name: 64,
    FLASHINFER_MLA_SPARSE_SM120.name: 64,
}

_16BIT = ("auto", "bfloat16", "float16")
#: ``is_quantized_kv_cache``: every cache dtype but the 16-bit ones
_FP8 = ("fp8", "fp8_e4m3")
#: each backend's ``supported_kv_cache_dtypes``
_STORES = {
    FLASH_ATTN_MLA_SPARSE.name: _16BIT,
    FLASHMLA_SPARSE.name: ("auto", "bfloat16", "fp8_ds_mla", "fp8", "nvfp4_ds_mla"),
    FLASHINFER_MLA_SPARSE_SM90.name: ("auto", "bfloat16", *_FP8),
    FLASH_ATTN_MLA_SPARSE_FA4.name: ("auto", "bfloat16"),
    FLASHINFER_MLA_SPARSE.name: (*_16BIT, *_FP8),
    FLASHINFER_MLA_SPARSE_SM120.name: ("auto", *_FP8, "fp8_ds_mla"),
}
_BY_NAME = {b.name: b for b in (
    FLASH_ATTN_MLA_SPARSE, FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE_SM90,
    FLASH_ATTN_MLA_SPARSE_FA4, FLASHINFER_MLA_SPARSE, FLASHINFER_MLA_SPARSE_SM120,
)}
#: the indexer's DeepGEMM kernel page (DeepseekV32IndexerBackend: exactly 64 tokens)
INDEXER_PAGE_TOKENS = 64
#: FA4's sparse decode takes these query-head counts (DCP 1)
_FA4_HEADS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SparseChoice:
    """The latents' backend and the cache vLLM stores for them."""

    backend: Backend
    #: the cache format after the layer's canonicalisation (e.g. fp8 -> fp8_ds_mla)
    kv_cache_dtype: str
    #: bytes of one token's latent (``state_content_bytes`` for the DS-MLA formats)
    bytes_per_token: int
    #: rows of a kernel page: blocks sit a whole number of such pages apart
    page_rows: int


def hooked_kv_dtype(shape: ModelShape, gpu: Gpu, kv_cache_dtype: str) -> str:
    """The cache dtype after the architecture's config hook (``models/config.py``
    ``GlmMoeDsaForCausalLM`` / ``Glm5NextModelConfig``: fp8 in place of auto on SM10x;
    ``DeepseekV32ForCausalLM``: bfloat16 read as auto)."""
    dims = shape.sparse_dims
    if dims is None:
        return kv_cache_dtype
    if kv_cache_dtype == "auto" and gpu.compute_capability[0] == 10 and dims.sm10x_auto_kv_dtype:
        return dims.sm10x_auto_kv_dtype
    if kv_cache_dtype == "bfloat16" and shape.architecture == "DeepseekV32ForCausalLM":
        return "auto"
    return kv_cache_dtype


def _candidates(gpu: Gpu, kv_cache_dtype: str, heads: int, latent: int) -> tuple[str, ...]:
    """The sparse tail of vLLM's CUDA priority list (platforms/cuda.py)."""
    major = gpu.compute_capability[0]
    if major == 9:
        tail = [FLASH_ATTN_MLA_SPARSE.name, FLASHMLA_SPARSE.name]
        if latent == 512:
            return (FLASHINFER_MLA_SPARSE_SM90.name, *tail)
        return (*tail, FLASHINFER_MLA_SPARSE_SM90.name)
    if major == 10:
        if kv_cache_dtype not in _16BIT:
            return (FLASHINFER_MLA_SPARSE.name, FLASHMLA_SPARSE.name)
        if heads <= 16:
            return (FLASH_ATTN_MLA_SPARSE_FA4.name, FLASHINFER_MLA_SPARSE.name,
                    FLASHMLA_SPARSE.name)
        return (FLASHMLA_SPARSE.name, FLASHINFER_MLA_SPARSE.name)
    if major == 12:
        return (FLASHINFER_MLA_SPARSE_SM120.name,)
    # FLASH_ATTN_MLA_SPARSE, FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE_SM90: SM90+ only
    return ()


def _refusal(name: str, shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, heads: int,
             block_size: int | None) -> str | None:
    """Why backend ``name`` does not take the model (``validate_configuration``)."""
    dims, latent = shape.sparse_dims, shape.mla_latent
    assert dims is not None
    major = gpu.compute_capability[0]
    if kv_cache_dtype not in _STORES[name]:
        return "kv_cache_dtype not supported"
    backend = _BY_NAME[name]
    if block_size is not None and not backend.blocks.accepts(block_size):
        return "block_size not supported"
    if name in (FLASHMLA_SPARSE.name, FLASHINFER_MLA_SPARSE_SM120.name,
                FLASH_ATTN_MLA_SPARSE_FA4.name, FLASHINFER_MLA_SPARSE_SM90.name) \
            and shape.dtype != "bfloat16":
        return "dtype not supported"
    if name == FLASHMLA_SPARSE.name:
        if latent == 512 and not (major == 9 and kv_cache_dtype in (*_16BIT, "fp8_ds_mla")
                                  and dims.qk_rope_head_dim == 0):
            return "head_size 512 only with bf16 or fp8_ds_mla kv-cache on SM90 (NoPE)"
        if kv_cache_dtype == "nvfp4_ds_mla" and major != 10:
            return "nvfp4_ds_mla on SM100 only"
        return None
    if name == FLASHINFER_MLA_SPARSE_SM90.name:
        if dims.kv_lora_rank != 512 or dims.qk_rope_head_dim not in (0, 64):
            return "requires kv_lora_rank=512 and qk_rope_head_dim in (0, 64)"
        return None
    if name == FLASH_ATTN_MLA_SPARSE.name:
        return None
    if name == FLASHINFER_MLA_SPARSE_SM120.name:
        return None if dims.index_topk == 2048 else "requires index_topk=2048"
    if name == FLASH_ATTN_MLA_SPARSE_FA4.name:
        if latent != 576:
            return "head_size not supported"
        if dims.index_topk % 128:
            return "FA4 sparse MLA requires index_topk % 128 == 0"
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (512, 64):
            return "FA4 sparse MLA requires (kv_lora_rank, qk_rope_head_dim) == (512, 64)"
        if heads not in _FA4_HEADS:
            return f"FA4 sparse MLA requires {_FA4_HEADS} gathered query heads"
        return None
    # FLASHINFER_MLA_SPARSE (TRT-LLM, SM10x)
    if latent not in (512, 576):
        return "head_size not supported"
    if dims.qk_rope_head_dim == 0:
        if (dims.qk_nope_head_dim, dims.kv_lora_rank) != (256, 512):
            return "FlashInfer native no-rope MLA requires qk_nope_head_dim=256, kv_lora_rank=512"
    elif dims.qk_nope_head_dim not in (128, 192):
        return "FlashInfer MLA Sparse kernel requires qk_nope_head_dim in [128, 192]"
    return None


def _stored(name: str, kv_cache_dtype: str, gpu: Gpu) -> str:
    """``_canonicalize_sparse_mla_kv_cache_dtype``: the format the layer keeps."""
    if name == FLASHMLA_SPARSE.name and kv_cache_dtype not in _16BIT:
        return kv_cache_dtype if kv_cache_dtype == "nvfp4_ds_mla" else "fp8_ds_mla"
    if name == FLASHINFER_MLA_SPARSE_SM120.name and kv_cache_dtype in ("auto", *_FP8):
        return "fp8_ds_mla"
    return kv_cache_dtype


def choose_sparse(
    shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, block_size: int | None, tp: int
) -> SparseChoice:
    """The sparse-MLA backend vLLM selects for the latents (``kv_cache_dtype`` after
    ``hooked_kv_dtype``), and the cache it stores; refused as vLLM refuses."""
    latent = shape.mla_latent
    heads = shape.num_attention_heads // tp
    names = _candidates(gpu, kv_cache_dtype, heads, latent)
    where = f"{gpu.name} (SM{gpu.compute_capability[0]}{gpu.compute_capability[1]})"
    if not names:
        raise UnsupportedModel(
            f"sparse MLA on {where}: vLLM 0.33.0 refuses it (No valid attention backend "
            "found: FLASH_ATTN_MLA_SPARSE, FLASHMLA_SPARSE and FLASHINFER_MLA_SPARSE_SM90 "
            "need compute capability 9.x)"
        )
    reasons = {n: _refusal(n, shape, gpu, kv_cache_dtype, heads, block_size) for n in names}
    taken = next((n for n in names if reasons[n] is None), None)
    if taken is None:
        said = "; ".join(f"{n}: {r}" for n, r in reasons.items())
        raise UnsupportedModel(
            f"sparse MLA with kv-cache dtype {kv_cache_dtype!r}, a {latent}-wide latent and "
            f"{heads} heads a rank"
            + (f" with --block-size {block_size}" if block_size is not None else "")
            + f" on {where}: vLLM 0.33.0 refuses it (No valid attention backend found: {said})"
        )
    stored = _stored(taken, kv_cache_dtype, gpu)
    if stored == "fp8_ds_mla":
        per_token = FP8_DS_MLA_BYTES_PER_TOKEN
    elif stored in DTYPE_BYTES or stored == "auto":
        per_token = latent * DTYPE_BYTES[shape.dtype if stored == "auto" else stored]
    else:
        raise UnsupportedModel(
            f"spec.engine.kvCacheDtype (--kv-cache-dtype) {stored!r} is not modelled: on "
            f"{gpu.name} vLLM 0.33.0 stores it only with {taken}, whose cache format "
            "Spillway does not reproduce; use auto, bfloat16, fp8, fp8_e4m3 or fp8_ds_mla"
        )
    rows = _PAGE_ROWS.get(taken, 1)
    if taken == FLASHMLA_SPARSE.name and stored not in _16BIT and gpu.compute_capability[0] != 10:
        rows = 64  # off SM100 its quantized kernel reads 64-token pages (customize_spec)
    return SparseChoice(_BY_NAME[taken], stored, per_token, rows)


def block_alignment(shape: ModelShape, gpu: Gpu) -> int:
    """The indexer's block alignment on ``gpu`` (DeepGEMM's pages: 64 entries on SM12x)."""
    dims = shape.sparse_dims
    if dims is not None and dims.sm12x_block_alignment and gpu.compute_capability[0] == 12:
        return dims.sm12x_block_alignment
    return shape.block_alignment
