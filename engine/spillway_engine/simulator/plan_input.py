"""A Spillway plan (``spillway plan --format json``) as the simulator's geometry.

The plan file is read by the planner's own reader
(:func:`spillway_engine.planner.plan.read_plan`), so the simulator takes exactly the
plans the engine takes. The per-group chunking -- blocks and tokens per chunk, and
how many chunks a windowed lookup needs -- is the plan's own
(``upstream.groups`` / ``spillway.groups``, whichever offloader the plan runs); the
simulator adds only what the plan does not state (GPU blocks a hit must find).

The GPU KV size is not in the plan (vLLM measures it at start-up): callers give it
(``--gpu-kv-blocks`` / ``--gpu-kv-tokens``), else :data:`DEFAULT_GPU_KV_TOKENS`.

Pool layout by offloader:
- ``upstream`` (vLLM 0.33.0): one pool of ``num_chunks`` rows shared by every
  (chunk, group) key.
- ``spillway``: the shipped connector's unit pool (``offloader.host_layout``): one pool
  of ``spillway.num_units`` units, a key of group g takes ``spillway.groups[g].units``
  of them, one LRU over all groups' keys. :attr:`SimPlan.host_layout` is that layout,
  read from the plan (no formula re-derived here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from spillway_engine.arith import cdiv
from spillway_engine.offloader.host_layout import HostLayout
from spillway_engine.planner.plan import Plan, PlanReadError, read_plan

#: Groups whose lookup is a plain prefix scan.
PREFIX_KINDS = ("full_attention", "mla")
#: Default GPU KV size when the command line gives none.
DEFAULT_GPU_KV_TOKENS = 131072


class PlanError(ValueError):
    """The plan file cannot drive the simulator; the message says why in one line."""


@dataclass(frozen=True)
class GroupGeometry:
    index: int
    kind: str
    num_layers: int
    tokens_per_block: int
    page_bytes: int
    window: int | None  # tokens kept (sliding window / attention chunk), None = all
    blocks_per_chunk: int
    tokens_per_chunk: int
    hashes_per_block: int
    hashes_per_chunk: int
    block_bytes: int  # one block of this group, summed over copies (workers)
    window_blocks: int | None  # GPU blocks a hit must find at its end
    window_chunks: int | None  # host chunks a hit must find at its end
    weight: int = 1  # groups this entry stands for (see merge_groups)
    members: tuple[int, ...] = ()
    #: host pool units one chunk takes (Spillway's unit pool; 1 row upstream), summed
    #: over the members once merged; member_units lists them in member order
    units: int = 1
    member_units: tuple[int, ...] = ()

    @property
    def windowed(self) -> bool:
        return self.kind not in PREFIX_KINDS


@dataclass(frozen=True)
class SimPlan:
    model_name: str
    offloader: str
    groups: tuple[GroupGeometry, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    num_chunks: int
    row_bytes: int
    capacity_tokens: int
    copies: int
    tensor_parallel_size: int
    max_model_len: int
    #: vLLM's ``cpu_kv_cache_size_tokens`` for the plan's offloader
    gauge_tokens: int
    #: the plan this geometry was derived from
    plan: Plan
    #: the shipped connector's host layout (Spillway plans), None for upstream plans
    host_layout: HostLayout | None = None

    @property
    def unit_pool(self) -> bool:
        """One pool of units shared by every group's keys (Spillway's manager)."""
        return self.host_layout is not None

    @property
    def align_tokens(self) -> int:
        """Common multiple of every group's block (hits and reuse happen on it)."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))


def parse_plan(plan: Plan) -> SimPlan:
    """The simulator's geometry of ``plan``; PlanError if the simulator cannot run it."""
    if not plan.kv_groups:
        raise PlanError("the plan has no kv_groups")
    section = plan.upstream if plan.offloader == "upstream" else plan.spillway
    if section is None:
        raise PlanError(
            f"the plan runs vLLM's offloader but has no upstream figures ({plan.upstream_refusal})"
        )
    if len(section.groups) != len(plan.kv_groups):
        raise PlanError(
            f"the plan has {len(plan.kv_groups)} kv_groups but {len(section.groups)} "
            f"{plan.offloader}.groups"
        )
    tph = plan.tokens_per_hash
    groups = []
    for index, (g, chunk) in enumerate(zip(plan.kv_groups, section.groups, strict=True)):
        tpb = g.tokens_per_block
        if tpb % tph:
            raise PlanError(
                f"plan kv_groups[{index}]: {tpb} tokens per block is not a multiple of the "
                f"{tph}-token hash unit"
            )
        window = None
        if g.kind in ("sliding_window", "chunked_local"):
            window = g.sliding_window or g.attention_chunk_size
            if not window:
                raise PlanError(f"plan kv_groups[{index}]: a {g.kind} group needs a window")
        window_blocks = None
        if window is not None:
            window_blocks = max(1, cdiv(window - 1, tpb))
        elif g.kind == "mamba":
            window_blocks = 1
        groups.append(
            GroupGeometry(
                index=index,
                kind=g.kind,
                num_layers=g.num_layers,
                tokens_per_block=tpb,
                page_bytes=g.page_bytes,
                window=window,
                blocks_per_chunk=chunk.blocks_per_chunk,
                tokens_per_chunk=chunk.tokens_per_chunk,
                hashes_per_block=tpb // tph,
                hashes_per_chunk=chunk.tokens_per_chunk // tph,
                # bytes_per_block: a mixed-page group's page_bytes is already its block
                block_bytes=g.bytes_per_block * section.copies,
                window_blocks=window_blocks,
                window_chunks=chunk.window_chunks,
                units=chunk.units if plan.offloader == "spillway" else 1,
                member_units=(chunk.units if plan.offloader == "spillway" else 1,),
            )
        )
    layout = None
    if plan.offloader == "spillway":
        layout = HostLayout.from_plan(plan)
    return SimPlan(
        model_name=plan.model.name or "spillway-sim",
        offloader=plan.offloader,
        groups=tuple(groups),
        tokens_per_hash=tph,
        blocks_per_chunk=plan.blocks_per_chunk,
        num_chunks=plan.num_chunks,
        row_bytes=plan.row_bytes,
        capacity_tokens=plan.capacity_tokens,
        copies=section.copies,
        tensor_parallel_size=plan.parallelism.tensor_parallel_size,
        max_model_len=plan.max_model_len,
        gauge_tokens=section.gauge_tokens,
        plan=plan,
        host_layout=layout,
    )


def load_plan(path: str | Path) -> SimPlan:
    """Read and parse a plan file; PlanError (one line) for every problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from e
    try:
        return parse_plan(read_plan(text, str(path)))
    except PlanReadError as e:
        raise PlanError(str(e)) from None


def merge_groups(groups: tuple[GroupGeometry, ...]) -> tuple[GroupGeometry, ...]:
    """Fold groups of identical geometry (kind, block, window, chunk) into one entry.

    Such groups get the same hits, allocations and frees at the same moments, so the
    simulator tracks them as one "class" whose blocks and host keys weigh ``weight``
    blocks / rows each (Gemma 3's six sliding-window groups become one class of 6).
    """
    merged: dict[tuple, list[GroupGeometry]] = {}
    for g in groups:
        merged.setdefault((g.kind, g.tokens_per_block, g.window, g.blocks_per_chunk), []).append(g)
    out = []
    for index, members in enumerate(merged.values()):
        first = members[0]
        out.append(
            replace(
                first,
                index=index,
                num_layers=sum(m.num_layers for m in members),
                block_bytes=sum(m.block_bytes for m in members),
                weight=len(members),
                members=tuple(m.index for m in members),
                units=sum(m.units for m in members),
                member_units=tuple(m.units for m in members),
            )
        )
    return tuple(out)


def gpu_blocks_for_tokens(plan: SimPlan, tokens: int) -> int:
    """GPU blocks for a KV size in tokens: every group needs a block per
    ``tokens_per_block`` tokens (vLLM's ``kv_cache_size_tokens`` read backwards)."""
    finest = min(g.tokens_per_block for g in plan.groups)
    return max(1, cdiv(tokens, finest)) * len(plan.groups)


def default_gpu_blocks(plan: SimPlan) -> int:
    """The GPU KV size when the caller gives none: :data:`DEFAULT_GPU_KV_TOKENS`."""
    return gpu_blocks_for_tokens(plan, DEFAULT_GPU_KV_TOKENS)
