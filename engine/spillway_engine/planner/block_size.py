"""Step 2 of ``kv_layout.compute_layout``: the block size
(``Platform.update_block_size_for_backend``): the kernels' preferred size, then for
attention+Mamba hybrids ``_align_hybrid_block_size`` (block raised until an attention
page holds a Mamba state, Mamba page padded to match).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from spillway_engine.arith import cdiv
from spillway_engine.planner.gpus import Backend, GdnKernel, Gpu, gdn_checkpoint_alignment
from spillway_engine.planner.layout_types import LayoutRequest
from spillway_engine.planner.shape import ModelShape, UnsupportedModel


def kernel_block_size(request: LayoutRequest, backend: Backend | None, gpu: Gpu) -> int:
    """Phase 1: the kernels' preferred block size, unless forced."""
    if request.block_size is not None:
        if request.block_size < 1:
            raise ValueError("block size must be positive")
        if backend is not None and not backend.blocks.accepts(request.block_size):
            raise UnsupportedModel(
                f"block size {request.block_size} is not supported by the "
                f"{backend.name} attention backend vLLM picks on {gpu.name}"
            )
        return request.block_size
    return backend.blocks.preferred() if backend is not None else 16


@dataclass(frozen=True)
class HybridBlock:
    """The block size after phase 2, and the Mamba states' cache (None: no Mamba layer)."""

    block: int
    mamba_mode: Literal["align", "none"] | None = None
    mamba_page: int | None = None
    mamba_padded: int | None = None
    #: the tokens one Mamba block covers: the block (align), else max_model_len
    mamba_block: int = 0


def hybrid_block(
    shape: ModelShape,
    gpu: Gpu,
    request: LayoutRequest,
    backend: Backend | None,
    block: int,
    per_token: int,
    gdn_kernel: GdnKernel | None,
    num_spec: int,
    notes: list[str],
) -> HybridBlock:
    """Phase 2: attention+Mamba hybrids (``Platform._align_hybrid_block_size``)."""
    if shape.mamba is None:
        if shape.block_alignment > 1:
            raise UnsupportedModel(
                f"{shape.architecture} without linear-attention layers is not modelled"
            )
        return HybridBlock(block)
    tp = request.tensor_parallel_size
    mamba_mode: Literal["align", "none"] = "align" if request.enable_prefix_caching else "none"
    mamba_page = shape.mamba.page_bytes(tp, shape.dtype, num_spec)
    if backend is None:
        # every layer a Mamba layer (a hybrid class whose config names no attention
        # layer): no attention backend to align to, so vLLM keeps the default block and
        # each block holds a whole state (update_block_size_for_backend returns early)
        notes.append(f"no attention layer: one {shape.mamba.family} state a {block}-token block")
        return HybridBlock(block, mamba_mode, mamba_page, None,
                           block if mamba_mode == "align" else _max_len(request))
    mamba_padded: int | None = None
    align = max(backend.blocks.base, block)
    if shape.mla_latent:
        align = max(align, 128)  # MLA decode kernels need 128-aligned block counts
    gdn_grid = gdn_checkpoint_alignment(gdn_kernel)
    if mamba_mode == "align" and gdn_grid:
        align = math.lcm(align, gdn_grid)
    checkpoint = shape.mamba.checkpoint_alignment
    checkpoint = checkpoint and checkpoint(gpu.compute_capability[0], shape.dtype)
    if mamba_mode == "align" and checkpoint:
        # only the spec carries it (num_prefill_checkpoint_blocks): the layer declares
        # no get_prefill_checkpoint_alignment, so the block is not aligned to it
        notes.append(
            f"{shape.mamba.family} prefill checkpoints every {checkpoint} tokens (one "
            "more state block per request)"
        )
    attn_block = align * cdiv(mamba_page, align * per_token)
    # a multiple of every attention backend's smallest kernel block
    base = math.lcm(backend.blocks.base, shape.block_alignment)
    attn_block = base * cdiv(attn_block, base)
    if block < attn_block:
        block = attn_block
        notes.append(
            f"block size raised to {block} tokens so an attention page holds a "
            f"{shape.mamba.family} state"
        )
    if not backend.blocks.accepts(block):
        raise UnsupportedModel(f"aligned block size {block} is not supported by {backend.name}")
    if block * per_token != mamba_page:
        mamba_padded = block * per_token
    mamba_block = block if mamba_mode == "align" else _max_len(request)
    return HybridBlock(block, mamba_mode, mamba_page, mamba_padded, mamba_block)


def _max_len(request: LayoutRequest) -> int:
    """Without prefix caching a Mamba block covers the whole context."""
    if request.max_model_len is None:
        raise ValueError("max_model_len is needed without prefix caching")
    return request.max_model_len
