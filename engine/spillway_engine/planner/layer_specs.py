"""Step 1 of ``kv_layout.compute_layout``: each layer's cache spec on one rank
(``Attention``/``MLAAttention``/``MambaBase`` ``get_kv_cache_spec``), with KV heads
split over TP and replicated when TP exceeds them (``ModelConfig.get_num_kv_heads``:
``max(1, kv_heads // tp)``), and the caches with their own state formats (compressed
MLA, GLM-5-Next's tail ring).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from spillway_engine.arith import cdiv, round_up
from spillway_engine.planner.gpus import FLASHINFER_MLA_SPARSE_SM90, Backend
from spillway_engine.planner.layout_types import CacheSpec
from spillway_engine.planner.shape import LayerKind, ModelShape, UnsupportedModel
from spillway_engine.planner.sparse_mla import SparseChoice


@dataclass(frozen=True)
class TokenBytes:
    """Attention bytes per token on one rank (an ``AttentionSpec`` with block_size 1)."""

    shape: ModelShape
    tp: int
    kv_bytes: int
    #: KV heads each rank stores (1 for an MLA latent)
    kv_heads: int
    #: the model's own heads' bytes per token
    per_token: int
    #: rows of a sparse-MLA kernel page: latent blocks sit whole pages apart
    page_rows: int = 1
    #: the per-token page vLLM's hybrid alignment reckons with: an MLA spec without
    #: the DS-MLA formats' state bytes (``_align_hybrid_block_size``); 0: ``per_token``
    nominal_per_token: int = 0

    @property
    def aligned_per_token(self) -> int:
        return self.nominal_per_token or self.per_token

    def of(self, layer: LayerKind) -> int:
        """Attention bytes per token of a layer with its own heads (else the model's)."""
        shape, tp, kv_bytes = self.shape, self.tp, self.kv_bytes
        if layer.bytes_per_token is not None:
            return layer.bytes_per_token
        if layer.num_kv_heads is None and layer.head_size is None:
            return self.per_token
        heads = shape.num_kv_heads if layer.num_kv_heads is None else layer.num_kv_heads
        if heads % tp and tp % heads:
            raise UnsupportedModel(f"{heads} KV heads cannot be split evenly over TP {tp}")
        size = shape.head_size if layer.head_size is None else layer.head_size
        return max(1, heads // tp) * 2 * size * kv_bytes


def token_bytes(
    shape: ModelShape, tp: int, kv_dtype: str, kv_bytes: int, backend: Backend | None,
    notes: list[str], sparse: SparseChoice | None = None,
) -> TokenBytes:
    """The per-token attention page of the model's heads on one rank."""
    kv_heads = 1 if shape.mla_latent else max(1, shape.num_kv_heads // tp)
    if not shape.mla_latent and shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise UnsupportedModel(f"{shape.num_kv_heads} KV heads cannot be split evenly over TP {tp}")
    if not shape.mla_latent and tp > shape.num_kv_heads:
        notes.append(
            f"TP {tp} exceeds the {shape.num_kv_heads} KV heads: each rank stores a full "
            "replicated head"
        )
    per_token = kv_heads * (shape.head_size + shape.head_size_v) * kv_bytes
    if sparse is not None:
        per_token = sparse.bytes_per_token  # the sparse kernel's own row format
    if backend is FLASHINFER_MLA_SPARSE_SM90:
        notes.append(
            "FLASHINFER_MLA_SPARSE_SM90 serves the latents: vLLM needs FlashInfer's "
            "kernels (flashinfer-cubin, or nvcc and ninja) for it, else it finds no backend"
        )
    nominal = kv_heads * (shape.head_size + shape.head_size_v) * kv_bytes
    return TokenBytes(shape, tp, kv_bytes, kv_heads, per_token,
                      sparse.page_rows if sparse else 1, nominal)


def layer_specs(
    shape: ModelShape,
    block: int,
    mamba_block: int,
    mamba_page: int | None,
    mamba_padded: int | None,
    tokens: TokenBytes,
    num_spec: int,
) -> list[CacheSpec]:
    """Every cache layer's spec, in layer order."""
    specs: list[CacheSpec] = []
    # One CacheSpec per LayerKind object (the family rules share one per kind of layer):
    # grouping then buckets by identity instead of hashing each layer's dataclass.
    made: dict[int, CacheSpec] = {}
    for layer in shape.layers:
        spec = made.get(id(layer))
        if spec is None:
            spec = made[id(layer)] = _layer_spec(
                layer, shape, block, mamba_block, mamba_page, mamba_padded, tokens.of,
                num_spec, tokens.page_rows,
            )
        specs.append(spec)
    return specs


def compressed_page_bytes(
    block_size: int, bytes_per_state: int, tokens_per_state: int = 1, alignment: int | None = None
) -> tuple[int, int]:
    """(page, unpadded page) of one layer of a one-head cache with its own state format.

    vLLM's ``AttentionSpec``: ``block_size // tokens_per_state`` states a block (a
    compressed MLA cache keeps one state per ``tokens_per_state`` tokens), each
    ``bytes_per_state`` (``state_content_bytes``); MLA specs with an ``alignment``
    round the page up to it (``_apply_alignment_padding``).
    """
    if tokens_per_state < 1 or block_size % tokens_per_state:
        raise UnsupportedModel(
            f"a {block_size}-token block does not hold whole states of {tokens_per_state} "
            "tokens"
        )
    raw = block_size // tokens_per_state * bytes_per_state
    return (round_up(raw, alignment) if alignment else raw), raw


def state_spec(layer: LayerKind, block: int) -> CacheSpec:
    """A layer with its own state format (``bytes_per_token`` per state)."""
    assert layer.bytes_per_token is not None
    own = layer.block_size or block
    page, raw = compressed_page_bytes(
        own, layer.bytes_per_token, layer.tokens_per_state, layer.page_alignment
    )
    return CacheSpec(
        layer.kind,
        own,
        page,
        layer.sliding_window,
        tokens_per_state=layer.tokens_per_state,
        true_page_bytes=raw,
    )


def _layer_spec(
    layer: LayerKind,
    shape: ModelShape,
    block: int,
    mamba_block: int,
    mamba_page: int | None,
    mamba_padded: int | None,
    layer_per_token: Callable[[LayerKind], int],
    num_spec: int = 0,
    page_rows: int = 1,
) -> CacheSpec:
    """One layer's spec on one rank (``get_kv_cache_spec``)."""
    if layer.kind == "mamba":
        assert mamba_page is not None
        return CacheSpec("mamba", mamba_block, mamba_padded or mamba_page)
    if layer.kind == "sliding_window" and shape.mla_latent:
        raise UnsupportedModel("sliding-window MLA is not modelled")
    if layer.kind == "circular_buffer":
        return _ring_spec(layer, block, num_spec)
    if layer.tokens_per_state > 1:
        return _kernel_strided(state_spec(layer, block), layer)
    layer_token = layer_per_token(layer)
    if shape.sparse_mla and layer.kind == "mla" and layer.bytes_per_token is None:
        # sparse kernels read flat rows in pages of ``page_rows`` (align_blocks_to_rows)
        return CacheSpec(layer.kind, block, block * layer_token, per_token=layer_token,
                         stride_alignment=page_rows * layer_token)
    return CacheSpec(
        layer.kind,
        block,
        block * layer_token,
        layer.sliding_window,
        layer.attention_chunk_size,
        layer_token,
    )


def _ring_spec(layer: LayerKind, block: int, num_spec: int) -> CacheSpec:
    """``Glm5NextTailCache``: one ring of raw keys per request (``CircularBufferSpec``),
    a pool plus the draft tokens rounded to a power of two of pools; never hashed."""
    unit, per_token = layer.ring_unit, layer.bytes_per_token
    assert unit is not None and per_token is not None
    ring = unit * (1 << (cdiv(unit + num_spec, unit) - 1).bit_length())
    if block % ring:
        raise UnsupportedModel(
            f"block size {block} is not a multiple of the {ring}-token tail ring; vLLM "
            f"asserts (Glm5NextTailCache: cache_config.block_size ({block}) must be a "
            f"multiple of the tail ring ({ring}))"
        )
    return CacheSpec("circular_buffer", ring, ring * per_token, prefix_cacheable=False)


def _kernel_strided(spec: CacheSpec, layer: LayerKind) -> CacheSpec:
    """``get_block_stride_alignment`` of a ``MultipleOf(kernel_block_tokens)`` spec: a
    block split into kernel pages keeps whole pages apart (one page if it is one)."""
    if layer.kernel_block_tokens is None:
        return spec
    kernel = math.gcd(layer.kernel_block_tokens, spec.block_size)
    if kernel == spec.block_size:
        return spec
    assert layer.bytes_per_token is not None
    page, _ = compressed_page_bytes(
        kernel, layer.bytes_per_token, layer.tokens_per_state, layer.page_alignment
    )
    return replace(spec, stride_alignment=page)
