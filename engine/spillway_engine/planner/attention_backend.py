"""The KV cache's dtype and the attention backend vLLM 0.33.0 picks for a model on a
GPU (the catalogue's per-generation priority lists in ``planner/gpus.py``; here the
model's side: MLA, sparse MLA, per-layer head sizes, sinks). Step 0 of
``kv_layout.compute_layout``: the backend fixes the kernels' block sizes.
"""

from __future__ import annotations

from spillway_engine.planner.gpus import (
    FLASH_ATTN,
    FLASH_ATTN_SM90_FP8_HD512,
    FLASHINFER,
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
from spillway_engine.planner.sparse_mla import choose_sparse

#: where a refusal of the KV dtype points: the object's field and the CLI's flag
KV_DTYPE_FIELD = "spec.engine.kvCacheDtype (--kv-cache-dtype)"

#: every ``--kv-cache-dtype`` vLLM 0.33.0 accepts (config/cache.py ``CacheDType``)
VLLM_KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
    "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
    "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact",
    "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
    "nvfp4", "nvfp4_4over6",
)

_16BIT = ("auto", "float16", "bfloat16")
_FP8 = ("fp8", "fp8_e4m3")
_TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
               "turboquant_3bit_nc")
#: ``supported_kv_cache_dtypes`` of each backend in vLLM 0.33.0's CUDA priority lists
#: for dense attention and dense MLA (FlashInfer's NVFP4 formats depend on the GPU:
#: ``_stores``)
_STORES: dict[str, tuple[str, ...]] = {
    "FLASH_ATTN": _16BIT + _FP8,
    "FLASHINFER": _16BIT + _FP8 + ("fp8_e5m2",),
    "TRITON_ATTN": _16BIT + _FP8 + (
        "fp8_e5m2", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"),
    "FLEX_ATTENTION": _16BIT,
    # the prefix-LM composites store what both of their backends store (composite.py)
    "TRITON_FLASH_ATTN": _16BIT + _FP8,
    "TRITON_FLASHINFER": _16BIT + _FP8 + ("fp8_e5m2",),
    "TURBOQUANT": _TURBOQUANT,
    "FLASHINFER_MLA": _16BIT + _FP8,
    "TOKENSPEED_MLA": _FP8,
    "CUTLASS_MLA": _16BIT + _FP8,
    "FLASH_ATTN_MLA": _16BIT,
    "FLASHMLA": _16BIT + _FP8,
    "TRITON_MLA": _16BIT + _FP8,
}


def _vllm_list(gpu: Gpu, mla: bool, mm_prefix: bool) -> tuple[str, ...]:
    """vLLM's CUDA priority list for dense attention or dense MLA on ``gpu``
    (platforms/cuda.py ``_get_backend_priorities``; the sparse tail adds no dense MLA)."""
    major = gpu.compute_capability[0]
    if mla:
        if major == 10:
            return ("FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA",
                    "FLASHMLA", "TRITON_MLA")
        if major == 12:
            return ("TRITON_MLA",)
        return ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA")
    if major == 10:
        return (("TRITON_FLASHINFER",) if mm_prefix else ()) + (
            "FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT")
    return (("TRITON_FLASH_ATTN",) if mm_prefix and major == 9 else ()) + (
        "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT")


def _stores(backend: str, kv_cache_dtype: str, gpu: Gpu) -> bool:
    if backend == "FLASHINFER" and kv_cache_dtype.startswith("nvfp4"):
        # FlashInferBackend.supports_kv_cache_dtype: every NVFP4 format on SM10x (TRT-LLM
        # kernels), plain nvfp4 only elsewhere (FA2 prefill over it)
        return gpu.compute_capability[0] == 10 or kv_cache_dtype == "nvfp4"
    return kv_cache_dtype in _STORES[backend]


def check_kv_dtype(shape: ModelShape, gpu: Gpu, kv_cache_dtype: str) -> None:
    """Refuses a ``--kv-cache-dtype`` as vLLM 0.33.0 does, with its reason, or one it
    takes but the planner does not model (``shape`` in the requested model dtype)."""
    if kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD}: vLLM 0.33.0 refuses {kv_cache_dtype!r} (Invalid "
            f"kv_cache_dtype: {kv_cache_dtype!r}. Valid values are: "
            f"{', '.join(VLLM_KV_CACHE_DTYPES)})"
        )
    if kv_cache_dtype in ("float16", "bfloat16") and kv_cache_dtype != shape.dtype:
        # VllmConfig._reject_mismatched_float_kv_cache
        allowed = f"`auto` or `{shape.dtype}`" if shape.dtype in _16BIT else "`auto`"
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD}: vLLM 0.33.0 refuses {kv_cache_dtype!r} for a "
            f"{shape.dtype} model (kv_cache_dtype=\"{kv_cache_dtype}\" is incompatible with "
            f"dtype=\"{shape.dtype}\". Please set `--kv-cache-dtype` to {allowed}.)"
        )
    mla = bool(shape.mla_latent)
    if mla and kv_cache_dtype.startswith("nvfp4") and kv_cache_dtype != "nvfp4_ds_mla":
        # VllmConfig: NVFP4 caches are refused with MLA before any backend is asked
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD}: vLLM 0.33.0 refuses {kv_cache_dtype!r} for "
            f"{shape.architecture} (nvfp4 KV cache is not supported with MLA (Multi-head "
            "Latent Attention) backends)"
        )
    attention = any(layer.kind != "mamba" for layer in shape.layers)
    if not attention or shape.sparse_mla or shape.compressed_sparse_mla:
        return  # no selector asked, or a sparse backend with rules of its own
    names = _vllm_list(gpu, mla, shape.mm_prefix)
    takers = [b for b in names if _stores(b, kv_cache_dtype, gpu)]
    if not takers:
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD}: vLLM 0.33.0 refuses {kv_cache_dtype!r} for "
            f"{shape.architecture}'s {'MLA' if mla else 'attention'} layers on {gpu.name} "
            f"(SM{gpu.compute_capability[0]}{gpu.compute_capability[1]}): No valid "
            f"attention backend found: {', '.join(names)}: kv_cache_dtype not supported"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD} {kv_cache_dtype!r} is not modelled: on {gpu.name} vLLM "
            f"0.33.0 stores it only with {', '.join(takers)}, whose cache format Spillway "
            f"does not reproduce; use one of {', '.join(KV_CACHE_DTYPES)}"
        )


def resolve_kv_dtype(shape: ModelShape, kv_cache_dtype: str, gpu: Gpu) -> tuple[str, int]:
    """The cache dtype ``--kv-cache-dtype`` resolves to (auto: the model's), and its
    bytes; refused as vLLM refuses it on ``gpu`` (``check_kv_dtype``)."""
    check_kv_dtype(shape, gpu, kv_cache_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"{KV_DTYPE_FIELD} {kv_cache_dtype!r} is not modelled; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    resolved = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return resolved, DTYPE_BYTES[resolved]


def choose_backend(
    shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, block_size: int | None, tp: int = 1
) -> Backend | None:
    """The backend the target's attention layers run on (None: no attention layer)."""
    if not any(layer.kind != "mamba" for layer in shape.layers):
        return None
    if shape.sparse_mla:
        check_kv_dtype(shape, gpu, kv_cache_dtype)
        return choose_sparse(shape, gpu, kv_cache_dtype, block_size, tp).backend
    if shape.mla_latent:
        return gpu.mla_backend(
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, head_size=shape.head_size
        )
    if any(layer.head_size not in (None, shape.head_size) for layer in shape.layers):
        if gpu.compute_capability[0] == 10:
            # Gemma4Config sets FA4 as FlashAttention's version, but SM10x lists FlashInfer
            # first and it takes every layer's head (256 and 512): 16-token pages
            heads = {shape.head_size} | {layer.head_size for layer in shape.layers} - {None}
            chosen = {gpu.attention_backend(mm_prefix=shape.mm_prefix, sinks=shape.sinks,
                                            kv_cache_dtype=kv_cache_dtype, head_size=h)
                      for h in heads}
            if chosen != {FLASHINFER}:
                raise UnsupportedModel(
                    f"{shape.architecture} with head sizes {sorted(heads)} on {gpu.name}: "
                    f"vLLM 0.33.0 runs its layers on {', '.join(sorted(b.name for b in chosen))}"
                    "; that mix is not modelled; plan it for a Hopper pool"
                )
            return FLASHINFER
        if gpu.generation != "hopper":
            # Gemma4Config: FA4 does not run on SM8x/SM12x, so it forces Triton
            return TRITON_ATTN
        # Gemma4Config on SM90: FA4 (shipped with vLLM's FlashAttention) for every layer,
        # MultipleOf(16) pages (its 128-token hd256 pages are SM100 only)...
        if kv_cache_dtype in ("auto", "bfloat16", "float16"):
            return FLASH_ATTN
        if kv_cache_dtype == "fp8_e5m2":
            raise UnsupportedModel(
                f"{KV_DTYPE_FIELD} 'fp8_e5m2' with {shape.architecture}'s per-layer head "
                f"sizes on {gpu.name} is not modelled: Gemma4Config asks for FlashAttention, "
                "which stores no fp8_e5m2 cache; use fp8 or auto"
            )
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
