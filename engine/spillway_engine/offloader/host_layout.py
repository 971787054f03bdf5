"""The host pool's layout, shared by Spillway's scheduler side (manager) and workers.

The pool is ``num_units`` equal units of ``unit_bytes`` on every worker (in the shared
region each unit row holds ``copies`` worker slots, like upstream's rows). A chunk of
offloaded group ``g`` spans ``chunk_tokens`` tokens = ``blocks_per_chunk`` GPU blocks
and takes ``units`` units, anywhere in the pool (the manager hands out unit ids).

Byte stream of one chunk of group ``g`` on one worker (what the units hold, in order):
for each layer reference ``r`` of the group (``CanonicalKVCaches.group_data_refs``, in
order), for each block ``j`` of the chunk, the first ``r.page_size_bytes`` bytes of that
block's page. The stream is cut into ``unit_bytes`` pieces: stream byte ``o`` lives in
the chunk's ``o // unit_bytes``-th unit at offset ``o % unit_bytes``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner needs pydantic; this module must not (workers, GPU checks)
    from spillway_engine.planner.plan import Plan

#: ``1`` puts the host pool in vLLM's shared ``/dev/shm`` region on any platform (the
#: emulated GPU in tests); by default only CUDA maps it there, as upstream does.
ENV_SHARED_REGION = "SPILLWAY_SHARED_REGION"
#: Prefix of the region's file(s) in /dev/shm (vLLM's ``SharedOffloadRegion``:
#: ``vllm_offload_{engine_id}.mmap`` plus ``.1``, ``.2``... segments).
REGION_FILE_PREFIX = "vllm_offload_"


def shared_region_forced() -> bool:
    return os.environ.get(ENV_SHARED_REGION, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class GroupSlots:
    #: vLLM KV-cache group index (the key's group, ``blocks.blocks[group_id]``)
    group_id: int
    #: index among the offloaded groups (order of ``GPULoadStoreSpec.group_sizes``)
    position: int
    tokens_per_block: int
    blocks_per_chunk: int
    #: true bytes of one chunk on one worker (unpadded pages of the group's layers)
    chunk_bytes: int
    #: units one chunk takes
    units: int
    #: chunks a lookup needs (sliding window, Mamba), None for full attention
    window_chunks: int | None = None


@dataclass(frozen=True)
class HostLayout:
    chunk_tokens: int
    #: bytes of one unit on one worker
    unit_bytes: int
    #: worker slots per unit row in the shared region (1 for replicated MLA)
    copies: int
    num_units: int
    groups: tuple[GroupSlots, ...]

    @classmethod
    def from_plan(cls, plan: Plan) -> HostLayout:
        """The layout a Spillway plan (``plan.spillway``) sizes the pool for: what the
        connector's geometry builds from vLLM's KV-cache config on a matching engine.
        The plan's chunk bytes count every rank; a group slot holds one worker's."""
        sw = plan.spillway
        groups = []
        for position, g in enumerate(sw.groups):
            if g.chunk_bytes % sw.copies:
                raise ValueError(f"plan group {g.group_index}: {g.chunk_bytes} chunk bytes "
                                 f"do not split over {sw.copies} copies")  # fmt: skip
            groups.append(
                GroupSlots(
                    group_id=g.group_index,
                    position=position,
                    tokens_per_block=g.tokens_per_block,
                    blocks_per_chunk=g.blocks_per_chunk,
                    chunk_bytes=g.chunk_bytes // sw.copies,
                    units=g.units,
                    window_chunks=g.window_chunks,
                )
            )
        return cls(
            chunk_tokens=sw.chunk_tokens,
            unit_bytes=sw.unit_bytes,
            copies=sw.copies,
            num_units=sw.num_units,
            groups=tuple(groups),
        )

    @property
    def region_bytes(self) -> int:
        return self.num_units * self.unit_bytes * self.copies

    @property
    def anchor_group(self) -> int:
        """The group whose chunks stand for "chunks of prefix": the first full-attention
        group (windowed groups keep only the chunks a lookup needs), else the first."""
        full = [g for g in self.groups if g.window_chunks is None]
        return (full or list(self.groups))[0].group_id

    def group(self, group_id: int) -> GroupSlots:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"KV-cache group {group_id} is not offloaded")
