"""Reading a Spillway plan (``spillway plan --format json``) into the simulator's geometry.

Only these keys are relied on: ``kv_groups`` (kind, num_layers, tokens_per_block,
page_bytes, sliding_window), ``tokens_per_hash``, ``worker_bytes_per_block``,
``blocks_per_chunk``, ``row_bytes``, ``num_chunks``, ``capacity_tokens``; others are
read defensively when present: ``model.name``, ``tensor_parallel_size`` (or
``parallelism.tensor_parallel_size``), ``offloader``, ``max_model_len``,
``gpu_kv_blocks``, per-group ``blocks_per_chunk`` under ``spillway.groups`` /
``upstream.groups``, and ``copies`` there.

Pool layout by offloader:
- ``upstream`` (vLLM 0.33.0): one pool of ``num_chunks`` rows shared by every
  (chunk, group) key.
- ``spillway``: each group has its own ``num_chunks`` rows (a "chunk set" of one row
  per group is what ``row_bytes`` prices).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

KINDS = ("full_attention", "sliding_window", "chunked_local", "mla", "mamba")
#: Groups whose lookup is a plain prefix scan.
PREFIX_KINDS = ("full_attention", "mla")
#: Default GPU KV size when neither the command line nor the plan gives one.
DEFAULT_GPU_KV_TOKENS = 131072
DEFAULT_MAX_MODEL_LEN = 131072


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
    gpu_kv_blocks: int | None
    raw: Mapping[str, Any]

    @property
    def per_group_pools(self) -> bool:
        return self.offloader == "spillway"

    @property
    def align_tokens(self) -> int:
        """Common multiple of every group's block (hits and reuse happen on it)."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int(data: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where}: '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{where}: '{key}' must be at least {minimum}, got {value}")
    return value


def _group_chunk_info(plan: Mapping[str, Any], offloader: str) -> list[Mapping[str, Any]]:
    section = plan.get(offloader)
    if isinstance(section, Mapping) and isinstance(section.get("groups"), list):
        return [g for g in section["groups"] if isinstance(g, Mapping)]
    return []


def parse_plan(plan: Any, gpu_kv_blocks: int | None = None) -> SimPlan:
    """Validate a plan dict and derive the per-group geometry; PlanError if unusable."""
    if not isinstance(plan, Mapping):
        raise PlanError("the plan must be a JSON object")
    groups_raw = plan.get("kv_groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise PlanError("the plan has no 'kv_groups' list")
    tph = _int(plan, "tokens_per_hash", "plan")
    bpc = _int(plan, "blocks_per_chunk", "plan")
    num_chunks = _int(plan, "num_chunks", "plan", minimum=0)
    row_bytes = _int(plan, "row_bytes", "plan", minimum=0)
    capacity = _int(plan, "capacity_tokens", "plan", minimum=0)
    _int(plan, "worker_bytes_per_block", "plan", minimum=0)
    offloader = plan.get("offloader") or "upstream"
    if offloader not in ("upstream", "spillway"):
        raise PlanError(f"plan: unknown offloader {offloader!r}")
    tp = plan.get("tensor_parallel_size")
    if tp is None and isinstance(plan.get("parallelism"), Mapping):
        tp = plan["parallelism"].get("tensor_parallel_size")
    tp = tp if isinstance(tp, int) and tp > 0 else 1
    section = plan.get(offloader)
    copies = section.get("copies") if isinstance(section, Mapping) else None
    copies = copies if isinstance(copies, int) and copies > 0 else tp
    chunk_info = _group_chunk_info(plan, offloader)

    groups = []
    for index, g in enumerate(groups_raw):
        where = f"plan kv_groups[{index}]"
        if not isinstance(g, Mapping):
            raise PlanError(f"{where} must be an object")
        kind = g.get("kind")
        if kind not in KINDS:
            raise PlanError(f"{where}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        tpb = _int(g, "tokens_per_block", where)
        layers = _int(g, "num_layers", where)
        page = _int(g, "page_bytes", where)
        if tpb % tph:
            raise PlanError(
                f"{where}: {tpb} tokens per block is not a multiple of the {tph}-token hash unit"
            )
        window = None
        if kind in ("sliding_window", "chunked_local"):
            window = g.get("sliding_window") or g.get("attention_chunk_size")
            if not isinstance(window, int) or window < 1:
                raise PlanError(f"{where}: a {kind} group needs a positive 'sliding_window'")
        group_bpc = bpc
        if index < len(chunk_info) and isinstance(chunk_info[index].get("blocks_per_chunk"), int):
            group_bpc = max(1, chunk_info[index]["blocks_per_chunk"])
        tpc = tpb * group_bpc
        window_blocks = window_chunks = None
        if window is not None:
            window_blocks = max(1, _cdiv(window - 1, tpb))
            window_chunks = max(_cdiv(window, tpc), _cdiv(window - 1, tpc))
        elif kind == "mamba":
            window_blocks = window_chunks = 1
        groups.append(
            GroupGeometry(
                index=index,
                kind=kind,
                num_layers=layers,
                tokens_per_block=tpb,
                page_bytes=page,
                window=window,
                blocks_per_chunk=group_bpc,
                tokens_per_chunk=tpc,
                hashes_per_block=tpb // tph,
                hashes_per_chunk=tpc // tph,
                block_bytes=page * layers * copies,
                window_blocks=window_blocks,
                window_chunks=window_chunks,
            )
        )

    model = plan.get("model")
    name = model.get("name") if isinstance(model, Mapping) else model
    if not isinstance(name, str) or not name:
        name = "spillway-sim"
    max_len = plan.get("max_model_len")
    max_len = max_len if isinstance(max_len, int) and max_len > 0 else DEFAULT_MAX_MODEL_LEN
    if gpu_kv_blocks is None:
        planned = plan.get("gpu_kv_blocks")
        gpu_kv_blocks = planned if isinstance(planned, int) and planned > 0 else None
    return SimPlan(
        model_name=name,
        offloader=offloader,
        groups=tuple(groups),
        tokens_per_hash=tph,
        blocks_per_chunk=bpc,
        num_chunks=num_chunks,
        row_bytes=row_bytes,
        capacity_tokens=capacity,
        copies=copies,
        tensor_parallel_size=tp,
        max_model_len=max_len,
        gpu_kv_blocks=gpu_kv_blocks,
        raw=dict(plan),
    )


def load_plan(path: str | Path, gpu_kv_blocks: int | None = None) -> SimPlan:
    """Read and parse a plan file; PlanError (one line) for every problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan file {path} is not valid JSON: {e.msg} (line {e.lineno})") from e
    return parse_plan(data, gpu_kv_blocks)


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
            )
        )
    return tuple(out)


def gpu_blocks_for_tokens(plan: SimPlan, tokens: int) -> int:
    """GPU blocks for a KV size in tokens: every group needs a block per
    ``tokens_per_block`` tokens (vLLM's ``kv_cache_size_tokens`` read backwards)."""
    finest = min(g.tokens_per_block for g in plan.groups)
    return max(1, _cdiv(tokens, finest)) * len(plan.groups)


def default_gpu_blocks(plan: SimPlan) -> int:
    if plan.gpu_kv_blocks:
        return plan.gpu_kv_blocks
    return gpu_blocks_for_tokens(plan, DEFAULT_GPU_KV_TOKENS)
