"""The KV cache's dtype and the attention backend vLLM 0.33.0 picks for a model on a
GPU (the catalogue's per-generation priority lists in ``planner/gpus.py``; here the
model's side: MLA, sparse MLA, per-layer head sizes, sinks). Step 0 of
``kv_layout.compute_layout``: the backend fixes the kernels' block sizes.
"""

from __future__ import annotations

from spillway_engine.planner.gpus import (
    FLASH_ATTN,
    FLASH_ATTN_SM90_FP8_HD512,
    TRITON_ATTN,
    Backend,
    Gpu,
)
from spillway_engine.planner.shape import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    ModelShape,
    UnsupportedModel,
)


def resolve_kv_dtype(shape: ModelShape, kv_cache_dtype: str) -> tuple[str, int]:
    """The cache dtype ``--kv-cache-dtype`` resolves to (auto: the model's), and its bytes."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"kv-cache dtype {kv_cache_dtype!r} is not modelled; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    resolved = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return resolved, DTYPE_BYTES[resolved]


def choose_backend(
    shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, block_size: int | None
) -> Backend | None:
    """The backend the target's attention layers run on (None: no attention layer)."""
    if not any(layer.kind != "mamba" for layer in shape.layers):
        return None
    if shape.sparse_mla:
        return gpu.sparse_mla_backend(
            kv_cache_dtype=kv_cache_dtype, head_size=shape.head_size, block_size=block_size
        )
    if shape.mla_latent:
        return gpu.mla_backend(
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, head_size=shape.head_size
        )
    if any(layer.head_size not in (None, shape.head_size) for layer in shape.layers):
        if gpu.compute_capability[0] == 10:
            raise UnsupportedModel(
                f"{shape.architecture} with per-layer head sizes on {gpu.name}: vLLM 0.33.0's "
                "Gemma4Config asks for FA4 there and lets FlashInfer take the layers it "
                "runs; that mix is not modelled yet; plan it for a Hopper pool"
            )
        if gpu.generation != "hopper":
            # Gemma4Config: FA4 does not run on SM8x/SM12x, so it forces Triton
            return TRITON_ATTN
        # Gemma4Config on SM90: FA4 (shipped with vLLM's FlashAttention) for every layer,
        # MultipleOf(16) pages (its 128-token hd256 pages are SM100 only)...
        if kv_cache_dtype in ("auto", "bfloat16", "float16"):
            return FLASH_ATTN
        # ...but with an FP8 cache FA3 on the head-256 layers and FA4 (exactly 64-token
        # FP8 pages) on the head-512 ones; the model's largest head makes 64 preferred.
        heads = {shape.head_size} | {layer.head_size for layer in shape.layers} - {None}
        if max(heads) != 512 or any(
            layer.kind == "sliding_window" and layer.head_size == 512 for layer in shape.layers
        ):
            raise UnsupportedModel(
                f"{shape.architecture} with head sizes {sorted(heads)} (sliding layers "
                f"{'with' if max(heads) == 512 else 'without'} head 512) and an FP8 KV cache "
                f"on {gpu.name}: only FA4's head-512 FP8 pages on full layers are modelled"
            )
        if block_size is not None and not FLASH_ATTN_SM90_FP8_HD512.blocks.accepts(block_size):
            raise UnsupportedModel(
                f"--block-size {block_size} with {shape.architecture}'s head-512 layers and "
                f"an FP8 KV cache on {gpu.name}: FlashAttention takes only multiples of 64 "
                "there (FA4's 64-token FP8 pages), so vLLM's selector falls back to another "
                "backend, which is not modelled; use a multiple of 64 or no --block-size"
            )
        return FLASH_ATTN_SM90_FP8_HD512
    return gpu.attention_backend(
        mm_prefix=shape.mm_prefix,
        kv_cache_dtype=kv_cache_dtype,
        sinks=shape.sinks,
        head_size=shape.head_size,
    )
