"""Spillway's host worker against vLLM 0.33.0's offloading interfaces, on CPU tensors.

CPU int8 tensors stand in for the GPU KV caches. Every transfer is checked against a
byte-level oracle written from the layout's definition (``offloader/layout.py``), not
from the planner: stored units hold exactly the chunk stream, loads rebuild the source
pages in other blocks, and nothing else changes (padding, other blocks, other units).
"""

from __future__ import annotations

import threading
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from spillway_engine.offloader.host_layout import GroupSlots, HostLayout
from spillway_engine.offloader.worker import (
    CopyPlan,
    SpillwayHostWorker,
    allocate_host_pool,
    check_layout_agreement,
    plan_copies,
)

# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Group:
    refs: tuple[tuple[int, int], ...]  # (tensor index, unpadded page bytes) per layer
    blocks_per_chunk: int
    tokens_per_block: int = 16


@dataclass(frozen=True)
class Case:
    rows: tuple[int, ...]  # bytes per block row of each canonical tensor (padded page)
    groups: tuple[Group, ...]
    unit_bytes: int
    # all tensors are strided views into one (num_blocks, sum(rows)) buffer
    interleaved: bool = False
    copies: int = 1


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def chunk_bytes(g: Group) -> int:
    return sum(p for _, p in g.refs) * g.blocks_per_chunk


def _gemma() -> Case:
    # 7 groups of 10/9/9/9/9/8/8 layers; layer i of every group shares tensor i (vLLM's
    # hybrid allocation). One unit = one layer's chunk, so a group takes units = layers.
    page, bpc = 48, 4
    layers = (10, 9, 9, 9, 9, 8, 8)
    groups = tuple(Group(tuple((i, page) for i in range(n)), bpc) for n in layers)
    return Case(rows=(page,) * 10, groups=groups, unit_bytes=page * bpc)


CASES = {
    # single full-attention group, 16 blocks per chunk, one unit per chunk
    "llama": Case(
        rows=(64,) * 4,
        groups=(Group(tuple((i, 64) for i in range(4)), 16),),
        unit_bytes=4 * 64 * 16,
    ),
    "gemma3": _gemma(),
    # attention group and Mamba group overlay the same tensors; Mamba pages (200 B)
    # are unpadded inside 256 B rows; 1100 B units cut pages of both groups
    "mamba_hybrid": Case(
        rows=(256,) * 3,
        groups=(
            Group(((0, 256), (1, 256), (2, 256)), 4),
            Group(((0, 200), (1, 200), (2, 200)), 4),
        ),
        unit_bytes=1100,
    ),
    # MLA latent, replicated (one copy); two layers interleaved per block row
    "mla": Case(
        rows=(72, 72),
        groups=(Group(((0, 72), (1, 72)), 8),),
        unit_bytes=2 * 72 * 8,
        interleaved=True,
    ),
    # group A: 16-token blocks, 4 per chunk; group B: 64-token blocks, 1 per chunk,
    # whose 200 B chunk is smaller than one 512 B unit; B's page is padded (row 256)
    "mixed_tpb": Case(
        rows=(64, 64, 256),
        groups=(Group(((0, 64), (1, 64)), 4, 16), Group(((2, 200),), 1, 64)),
        unit_bytes=512,
    ),
    # pages (160 B) larger than a unit (64 B): each page spans 3-4 units
    "tiny_units": Case(
        rows=(160, 176),
        groups=(Group(((0, 160), (1, 160)), 2),),
        unit_bytes=64,
    ),
}


def make_layout(
    case: Case, num_units: int, extra_bytes: dict[int, int] | None = None
) -> HostLayout:
    spans = {g.blocks_per_chunk * g.tokens_per_block for g in case.groups}
    assert len(spans) == 1, "one chunk span for every group"
    slots = tuple(
        GroupSlots(
            group_id=10 + i,  # vLLM ids differ from positions on purpose
            position=i,
            tokens_per_block=g.tokens_per_block,
            blocks_per_chunk=g.blocks_per_chunk,
            chunk_bytes=chunk_bytes(g) + (extra_bytes or {}).get(i, 0),
            units=cdiv(chunk_bytes(g), case.unit_bytes),
        )
        for i, g in enumerate(case.groups)
    )
    return HostLayout(
        chunk_tokens=spans.pop(),
        unit_bytes=case.unit_bytes,
        copies=case.copies,
        num_units=num_units,
        groups=slots,
    )


def rand_int8(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


def make_tensors(case: Case, num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    if not case.interleaved:
        return [rand_int8(gen, num_blocks, row) for row in case.rows]
    buf = rand_int8(gen, num_blocks, sum(case.rows))
    out, offset = [], 0
    for row in case.rows:
        out.append(buf.as_strided((num_blocks, row), (buf.stride(0), 1), offset))
        offset += row
    return out


def make_caches(case: Case, tensors: list[torch.Tensor]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, r) for t, r in zip(tensors, case.rows, strict=True)],
        group_data_refs=[[CanonicalKVCacheRef(t, p) for t, p in g.refs] for g in case.groups],
    )


def backing(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the whole backing buffers, so bytes outside the views count too."""
    out, seen = [], set()
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(torch.empty(0, dtype=torch.int8).set_(s, 0, (s.nbytes(),), (1,)).clone())
    return out


# --------------------------------------------------------------------------- oracle


def page_units(g: Group, ref: int, in_chunk: int, unit_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(unit within the chunk, byte in unit) of each byte of one page: layout.py's stream."""
    start = sum(p for _, p in g.refs[:ref]) * g.blocks_per_chunk + in_chunk * g.refs[ref][1]
    o = np.arange(start, start + g.refs[ref][1])
    return o // unit_bytes, o % unit_bytes


def oracle_store(
    case: Case,
    pool: np.ndarray,
    tensors: list[torch.Tensor],
    blocks: list[dict[int, int]],
    units: list[dict[int, np.ndarray]],
) -> np.ndarray:
    """The pool after storing ``blocks[g]`` (logical block -> GPU block id)."""
    out = pool.copy()
    for g, grp in enumerate(case.groups):
        bpc = grp.blocks_per_chunk
        for logical, gid in blocks[g].items():
            for r, (t, page) in enumerate(grp.refs):
                u, b = page_units(grp, r, logical % bpc, case.unit_bytes)
                out[units[g][logical // bpc][u], b] = tensors[t][gid, :page].numpy()
    return out


def oracle_load(
    case: Case, before: list[torch.Tensor], src: list[dict[int, int]], dst: list[dict[int, int]]
) -> list[torch.Tensor]:
    """The GPU tensors after loading the stored pages of ``src`` into ``dst`` blocks."""
    out = [t.clone() for t in before]
    for g, grp in enumerate(case.groups):
        for logical, gid in dst[g].items():
            for t, page in grp.refs:
                out[t][gid, :page] = before[t][src[g][logical], :page]
    return out


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    store: tuple[tuple[int, int], ...]  # per group (first logical block, count)
    load: tuple[tuple[int, int], ...]


def make_scenario(case: Case, kind: str) -> Scenario:
    bpcs = [g.blocks_per_chunk for g in case.groups]
    partial = tuple((b + b // 3 + (b > 1), 2 * b + 1) for b in bpcs)
    if kind == "aligned":
        full = tuple((0, 2 * b) for b in bpcs)
        return Scenario(full, full)
    if kind == "partial":  # block_indices not a multiple of bpc; last chunk partial too
        return Scenario(partial, partial)
    assert kind == "subset"  # a few blocks out of a chunk; odd groups load nothing
    load = tuple(
        (first + 1, max(1, b // 2)) if i % 2 == 0 else (0, 0)
        for i, ((first, _), b) in enumerate(zip(partial, bpcs, strict=True))
    )
    return Scenario(partial, load)


@dataclass
class Plan:
    """Block ids and unit ids chosen for one scenario."""

    src: list[dict[int, int]]  # per group: logical block -> GPU block holding its KV
    dst: list[dict[int, int]]  # per group: logical block -> GPU block to load into
    units: list[dict[int, np.ndarray]]  # per group: chunk ordinal -> its unit ids
    num_blocks: int
    num_units: int


def choose(case: Case, sc: Scenario, rng: np.random.Generator) -> Plan:
    need_blocks = sum(n for _, n in sc.store) + sum(n for _, n in sc.load)
    num_blocks = need_blocks + 7
    # groups overlay the same tensors in vLLM: every block id belongs to one group
    block_ids = iter(rng.permutation(num_blocks).tolist())
    src = [{first + k: next(block_ids) for k in range(n)} for first, n in sc.store]
    dst = [{first + k: next(block_ids) for k in range(n)} for first, n in sc.load]
    chunk_ords = [
        sorted({b // g.blocks_per_chunk for b in s}) for g, s in zip(case.groups, src, strict=True)
    ]
    units_per_chunk = [cdiv(chunk_bytes(g), case.unit_bytes) for g in case.groups]
    num_units = sum(len(c) * u for c, u in zip(chunk_ords, units_per_chunk, strict=True)) + 5
    unit_ids = iter(rng.permutation(num_units).tolist())  # 5 units stay unnamed
    units = [
        {c: np.array([next(unit_ids) for _ in range(u)]) for c in ords}
        for ords, u in zip(chunk_ords, units_per_chunk, strict=True)
    ]
    return Plan(src, dst, units, num_blocks, num_units)


def specs(
    case: Case, ranges: tuple[tuple[int, int], ...], blocks: list[dict[int, int]], plan: Plan
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    gpu_ids: list[int] = []
    unit_ids: list[int] = []
    for g, ((first, n), grp) in enumerate(zip(ranges, case.groups, strict=True)):
        gpu_ids += [blocks[g][first + k] for k in range(n)]
        if n:
            bpc = grp.blocks_per_chunk
            for c in range(first // bpc, (first + n - 1) // bpc + 1):
                unit_ids += plan.units[g][c].tolist()
    gpu = GPULoadStoreSpec(
        gpu_ids, group_sizes=[n for _, n in ranges], block_indices=[f for f, _ in ranges]
    )
    return gpu, CPULoadStoreSpec(unit_ids)


def page_bytes(case: Case, ranges: tuple[tuple[int, int], ...]) -> int:
    return sum(n * sum(p for _, p in g.refs) for (_, n), g in zip(ranges, case.groups, strict=True))


@dataclass
class Rig:
    case: Case
    plan: Plan
    layout: HostLayout
    tensors: list[torch.Tensor]
    pool: torch.Tensor
    worker: SpillwayHostWorker


def build_rig(case: Case, sc: Scenario, seed: int = 0) -> Rig:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    plan = choose(case, sc, rng)
    layout = make_layout(case, plan.num_units)
    tensors = make_tensors(case, plan.num_blocks, gen)
    pool = rand_int8(gen, plan.num_units, case.unit_bytes)  # random: "untouched" shows
    worker = SpillwayHostWorker(make_caches(case, tensors), layout, pool)
    return Rig(case, plan, layout, tensors, pool, worker)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", ["aligned", "partial", "subset"])
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_byte_exact(name: str, kind: str) -> None:
    case = CASES[name]
    sc = make_scenario(case, kind)
    rig = build_rig(case, sc, seed=zlib.crc32(f"{name}/{kind}".encode()))
    plan = rig.plan

    gpu_before = [t.clone() for t in rig.tensors]
    backing_before = backing(rig.tensors)
    pool_before = rig.pool.numpy().copy()

    store_gpu, store_cpu = specs(case, sc.store, plan.src, plan)
    assert rig.worker.submit_store(1, store_gpu, store_cpu)
    rig.worker.wait({1})
    expected_pool = oracle_store(case, pool_before, gpu_before, plan.src, plan.units)
    # exactly the chunk streams land; every other byte (unnamed units, the skipped
    # part of partial chunks, unit slack) is untouched
    np.testing.assert_array_equal(rig.pool.numpy(), expected_pool)
    for before, after in zip(backing_before, backing(rig.tensors), strict=True):
        assert torch.equal(before, after), "a store wrote to the KV caches"
    named = {u for g in plan.units for us in g.values() for u in us.tolist()}
    for u in set(range(plan.num_units)) - named:
        np.testing.assert_array_equal(rig.pool.numpy()[u], pool_before[u])

    pool_after_store = rig.pool.clone()
    load_gpu, load_cpu = specs(case, sc.load, plan.dst, plan)
    assert rig.worker.submit_load(2, load_cpu, load_gpu)
    rig.worker.wait({2})
    expected = oracle_load(case, gpu_before, plan.src, plan.dst)
    for t, (got, want) in enumerate(zip(rig.tensors, expected, strict=True)):
        assert torch.equal(got, want), f"tensor {t} differs after the load"
    # loaded pages equal the source pages; padding beyond the page stays as it was
    for g, grp in enumerate(case.groups):
        for logical, gid in plan.dst[g].items():
            for t, page in grp.refs:
                src_gid = plan.src[g][logical]
                assert torch.equal(rig.tensors[t][gid, :page], gpu_before[t][src_gid, :page])
                assert torch.equal(rig.tensors[t][gid, page:], gpu_before[t][gid, page:])
    assert torch.equal(rig.pool, pool_after_store), "a load wrote to the pool"

    results = {r.job_id: r for r in rig.worker.get_finished()}
    assert set(results) == {1, 2}
    assert all(r.success for r in results.values())
    assert results[1].transfer_size == page_bytes(case, sc.store)
    assert results[2].transfer_size == page_bytes(case, sc.load)


def test_expedited_load_and_group_with_nothing_to_move() -> None:
    case = CASES["gemma3"]
    sc = make_scenario(case, "aligned")
    rig = build_rig(case, sc, seed=7)
    store_gpu, store_cpu = specs(case, sc.store, rig.plan.src, rig.plan)
    rig.worker.submit_store(5, store_gpu, store_cpu)
    # only group 3 loads; the rest have group size 0 and no units
    only3 = tuple(r if i == 3 else (0, 0) for i, r in enumerate(sc.load))
    before = [t.clone() for t in rig.tensors]
    load_gpu, load_cpu = specs(case, only3, rig.plan.dst, rig.plan)
    assert len(load_cpu.block_ids) == 2 * 9  # 2 chunks x 9 units (one per layer)
    assert rig.worker.submit_load(6, load_cpu, load_gpu, expedited=True)
    rig.worker.wait({5, 6})
    dst_only3 = [d if i == 3 else {} for i, d in enumerate(rig.plan.dst)]
    expected = oracle_load(case, before, rig.plan.src, dst_only3)
    assert all(torch.equal(a, b) for a, b in zip(rig.tensors, expected, strict=True))
    sizes = {r.job_id: r.transfer_size for r in rig.worker.get_finished()}
    assert sizes == {5: page_bytes(case, sc.store), 6: page_bytes(case, only3)}


def test_round_trip_through_a_shared_region_slot() -> None:
    """Rank 1's slot of a 2-copy shared region: strided unit rows, rank 0 untouched."""
    case = replace(CASES["mamba_hybrid"], unit_bytes=4096, copies=2)
    sc = make_scenario(case, "partial")
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    plan = choose(case, sc, rng)
    layout = make_layout(case, plan.num_units)
    pools, cleanups = shared_pools(layout, replicated=False)
    p0, p1 = pools
    try:
        assert p1.stride() == (2 * 4096, 1)
        p0.fill_(7)
        p1.copy_(rand_int8(gen, plan.num_units, 4096))
        pool_before = p1.numpy().copy()
        tensors = make_tensors(case, plan.num_blocks, gen)
        before = [t.clone() for t in tensors]
        worker = SpillwayHostWorker(make_caches(case, tensors), layout, p1)
        store_gpu, store_cpu = specs(case, sc.store, plan.src, plan)
        worker.submit_store(1, store_gpu, store_cpu)
        np.testing.assert_array_equal(
            p1.numpy(), oracle_store(case, pool_before, before, plan.src, plan.units)
        )
        assert bool((p0 == 7).all()), "rank 1 wrote into rank 0's slots"
        load_gpu, load_cpu = specs(case, sc.load, plan.dst, plan)
        worker.submit_load(2, load_cpu, load_gpu)
        expected = oracle_load(case, before, plan.src, plan.dst)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))
        worker.shutdown()
    finally:
        del p0, p1, pools
        for c in cleanups:
            c()


# --------------------------------------------------------------------------- planner


def byte_map(plan_pieces: CopyPlan) -> dict[tuple[int, int], int]:
    """(tensor, gpu byte) -> host byte, from a CopyPlan."""
    out = {}
    for t, g, h, n in zip(
        plan_pieces.tensor_idx.tolist(),
        plan_pieces.gpu_offsets.tolist(),
        plan_pieces.host_offsets.tolist(),
        plan_pieces.sizes.tolist(),
        strict=True,
    ):
        assert n > 0
        for i in range(n):
            assert (t, g + i) not in out, "a GPU byte is copied twice"
            out[t, g + i] = h + i
    return out


def oracle_byte_map(
    case: Case, rows: list[int], blocks: list[dict[int, int]], units: list[dict[int, np.ndarray]]
) -> dict[tuple[int, int], int]:
    out = {}
    for g, grp in enumerate(case.groups):
        bpc = grp.blocks_per_chunk
        for logical, gid in blocks[g].items():
            for r, (t, _) in enumerate(grp.refs):
                u, b = page_units(grp, r, logical % bpc, case.unit_bytes)
                hosts = units[g][logical // bpc][u] * case.unit_bytes + b
                for i, h in enumerate(hosts.tolist()):
                    out[t, gid * rows[t] + i] = h
    return out


@pytest.mark.parametrize("kind", ["aligned", "partial", "subset"])
@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_the_layout_byte_for_byte(name: str, kind: str) -> None:
    case = CASES[name]
    sc = make_scenario(case, kind)
    plan = choose(case, sc, np.random.default_rng(1))
    layout = make_layout(case, plan.num_units)
    refs = make_caches(case, make_tensors(case, 1, torch.Generator())).group_data_refs
    # interleaved tensors step by the whole buffer row
    rows = [sum(case.rows)] * len(case.rows) if case.interleaved else list(case.rows)
    gpu, cpu = specs(case, sc.load, plan.dst, plan)
    want = oracle_byte_map(case, rows, plan.dst, plan.units)
    for coalesce in (True, False):
        load = plan_copies(
            layout, refs, gpu, cpu, store=False, gpu_row_bytes=rows, coalesce=coalesce
        )
        assert byte_map(load) == want
        assert load.num_bytes == page_bytes(case, sc.load)
        assert load.src_offsets is load.host_offsets and load.dst_offsets is load.gpu_offsets
    store = plan_copies(layout, refs, gpu, cpu, store=True, gpu_row_bytes=rows)
    assert store.src_offsets is store.gpu_offsets and store.dst_offsets is store.host_offsets


def test_plan_cuts_pages_at_unit_boundaries_and_coalesces_runs() -> None:
    case = Case(rows=(100,), groups=(Group(((0, 100),), 4),), unit_bytes=150)
    layout = make_layout(case, num_units=10)  # chunk 400 B = 3 units (450 B)
    refs = [[CanonicalKVCacheRef(0, 100)]]
    # logical blocks 1, 2 of chunk 0 (stream bytes 100..300) from GPU blocks 7, 8
    gpu = GPULoadStoreSpec([7, 8], group_sizes=[2], block_indices=[1])
    cpu = CPULoadStoreSpec([4, 6, 9])
    p = plan_copies(layout, refs, gpu, cpu, store=True, gpu_row_bytes=[100], coalesce=False)
    # stream 100..150 -> unit 4 @100; 150..200 -> unit 6 @0; 200..300 -> unit 6 @50
    assert p.gpu_offsets.tolist() == [700, 750, 800]
    assert p.host_offsets.tolist() == [4 * 150 + 100, 6 * 150, 6 * 150 + 50]
    assert p.sizes.tolist() == [50, 50, 100]
    # blocks 7, 8 are adjacent rows and unit 6 is contiguous: the last two merge
    merged = plan_copies(layout, refs, gpu, cpu, store=True, gpu_row_bytes=[100])
    assert merged.gpu_offsets.tolist() == [700, 750]
    assert merged.host_offsets.tolist() == [700, 900]
    assert merged.sizes.tolist() == [50, 150]
    # a strided host view (two slots per row) moves units, not offsets inside them
    wide = plan_copies(layout, refs, gpu, cpu, store=True, gpu_row_bytes=[100], host_row_bytes=300)
    assert wide.host_offsets.tolist() == [4 * 300 + 100, 6 * 300]
    assert wide.sizes.tolist() == [50, 150]


# --------------------------------------------------------------------------- errors


def test_layout_disagreement_names_the_group_and_both_sizes() -> None:
    case = CASES["mamba_hybrid"]
    layout = make_layout(case, num_units=8, extra_bytes={1: 24})
    tensors = make_tensors(case, 4, torch.Generator())
    with pytest.raises(ValueError, match=r"group 11 .*2400 bytes per chunk.* 2424"):
        SpillwayHostWorker(
            make_caches(case, tensors), layout, torch.zeros(8, 1100, dtype=torch.int8)
        )
    with pytest.raises(ValueError, match="refs for 1 offloaded groups"):
        check_layout_agreement(layout, make_caches(case, tensors).group_data_refs[:1])


def test_pool_view_must_match_the_layout() -> None:
    case = CASES["llama"]
    layout = make_layout(case, num_units=8)
    caches = make_caches(case, make_tensors(case, 4, torch.Generator()))
    with pytest.raises(ValueError, match=r"\(8, 4096\)"):
        SpillwayHostWorker(caches, layout, torch.zeros(7, 4096, dtype=torch.int8))


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_unit_count_fails_before_copying(delta: int) -> None:
    case = CASES["gemma3"]
    sc = make_scenario(case, "partial")
    rig = build_rig(case, sc, seed=11)
    gpu, cpu = specs(case, sc.store, rig.plan.src, rig.plan)
    ids = cpu.block_ids.tolist()
    bad = CPULoadStoreSpec(ids[:-1] if delta < 0 else [*ids, ids[0]])
    pool_before = rig.pool.clone()
    with pytest.raises(ValueError, match=rf"names {len(ids) + delta} units, .* needs {len(ids)}"):
        rig.worker.submit_store(1, gpu, bad)
    assert torch.equal(rig.pool, pool_before)
    assert rig.worker.get_finished() == []


def test_out_of_range_ids_are_refused() -> None:
    case = CASES["llama"]
    sc = make_scenario(case, "aligned")
    rig = build_rig(case, sc)
    gpu, cpu = specs(case, sc.store, rig.plan.src, rig.plan)
    too_far = cpu.block_ids.copy()
    too_far[0] = rig.plan.num_units
    with pytest.raises(ValueError, match="unit ids out of range"):
        rig.worker.submit_store(1, gpu, CPULoadStoreSpec(too_far.tolist()))
    bad_gpu = GPULoadStoreSpec(
        [rig.plan.num_blocks, *gpu.block_ids.tolist()[1:]],
        group_sizes=gpu.group_sizes,
        block_indices=gpu.block_indices,
    )
    with pytest.raises(ValueError, match="GPU block ids out of range"):
        rig.worker.submit_store(1, bad_gpu, cpu)


# --------------------------------------------------------------------------- job bookkeeping


def test_jobs_are_reported_once_with_their_bytes() -> None:
    case = CASES["mixed_tpb"]
    sc = make_scenario(case, "partial")
    rig = build_rig(case, sc, seed=5)
    assert isinstance(rig.worker, OffloadingWorker)
    assert rig.worker.get_finished() == []
    rig.worker.wait(set())
    store_gpu, store_cpu = specs(case, sc.store, rig.plan.src, rig.plan)
    load_gpu, load_cpu = specs(case, sc.load, rig.plan.dst, rig.plan)
    assert rig.worker.submit_store(10, store_gpu, store_cpu)
    assert rig.worker.submit_load(11, load_cpu, load_gpu)
    assert rig.worker.submit_load(12, load_cpu, load_gpu, expedited=True)
    empty = GPULoadStoreSpec([], group_sizes=[0, 0], block_indices=[0, 0])
    assert rig.worker.submit_store(13, empty, CPULoadStoreSpec([]))
    rig.worker.wait({10, 11, 12, 13, 99})  # unknown ids are fine
    results = rig.worker.get_finished()
    assert sorted(r.job_id for r in results) == [10, 11, 12, 13]
    by_id = {r.job_id: r for r in results}
    assert all(r.success for r in results)
    assert by_id[10].transfer_size == page_bytes(case, sc.store)
    assert by_id[11].transfer_size == by_id[12].transfer_size == page_bytes(case, sc.load)
    assert by_id[13].transfer_size == 0
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in results)
    assert rig.worker.get_finished() == []
    released = []
    worker = SpillwayHostWorker(
        make_caches(case, rig.tensors), rig.layout, rig.pool, release=lambda: released.append(1)
    )
    worker.shutdown()
    worker.shutdown()
    assert released == [1]
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit_store(1, store_gpu, store_cpu)


def test_a_modelled_link_finishes_jobs_when_it_would_have_carried_them() -> None:
    """An emulated GPU's host link: bytes move at submit, but a job is reported only
    once its modelled time has passed, stores and loads queued per direction."""
    case = CASES["mixed_tpb"]
    sc = make_scenario(case, "partial")
    rig = build_rig(case, sc, seed=6)
    per_byte = 0.2 / page_bytes(case, sc.store)  # a store takes 0.2 s
    worker = SpillwayHostWorker(make_caches(case, rig.tensors), rig.layout, rig.pool,
                                link_s=lambda n: n * per_byte)
    store_gpu, store_cpu = specs(case, sc.store, rig.plan.src, rig.plan)
    load_gpu, load_cpu = specs(case, sc.load, rig.plan.dst, rig.plan)
    assert worker.submit_store(1, store_gpu, store_cpu)
    assert worker.submit_store(2, store_gpu, store_cpu)  # queued behind job 1
    assert worker.submit_load(3, load_cpu, load_gpu)  # the other direction: not queued
    assert worker.get_finished() == []
    worker.wait({1})
    first = {r.job_id: r for r in worker.get_finished()}
    # 2 is still on the link; 3, on the other direction's, takes about as long as 1
    # and may be done too (a race the test must not depend on).
    assert 1 in first and 2 not in first, sorted(first)
    worker.wait({2, 3} - set(first))
    results = {**first, **{r.job_id: r for r in worker.get_finished()}}
    assert sorted(results) == [1, 2, 3]
    assert results[2].transfer_time == pytest.approx(0.4, abs=0.05)  # after job 1
    assert results[3].transfer_time == pytest.approx(
        page_bytes(case, sc.load) * per_byte, abs=0.05)
    worker.shutdown()


# --------------------------------------------------------------------------- host pool


def shared_pools(
    layout: HostLayout, replicated: bool, world_size: int = 2
) -> tuple[list[torch.Tensor], list]:
    """Every rank's view of one SharedOffloadRegion, ranks as threads of this process."""
    engine_id = f"spillway-test-{uuid.uuid4().hex}"
    barrier = threading.Barrier(world_size)
    pools: list = [None] * world_size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pools[r] = allocate_host_pool(
                layout, engine_id, r, world_size, replicated, shared=True, barrier=barrier.wait
            )
        except BaseException as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # the barrier let the creator unlink the file: it lives on in the mappings only
    assert not Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()
    return [p for p, _ in pools], [c for _, c in pools]


def test_host_pool_is_a_private_tensor_off_cuda() -> None:
    layout = make_layout(CASES["llama"], num_units=6)
    pool, cleanup = allocate_host_pool(layout, "e", 0, 1, replicated=False)
    assert pool.shape == (6, 4096) and pool.dtype == torch.int8 and not pool.any()
    cleanup()
    with pytest.raises(ValueError, match="copies"):
        allocate_host_pool(layout, "e", 0, 2, replicated=False)
    with pytest.raises(ValueError, match="shared"):
        allocate_host_pool(layout, "e", 0, 2, replicated=True)


def test_shared_region_gives_each_rank_its_own_slot() -> None:
    layout = replace(make_layout(CASES["llama"], num_units=5), copies=2)
    (p0, p1), cleanups = shared_pools(layout, replicated=False)
    try:
        assert p0.shape == p1.shape == (5, 4096)
        assert p0.stride() == p1.stride() == (8192, 1)
        p0.fill_(1)
        p1.fill_(2)
        assert bool((p0 == 1).all()) and bool((p1 == 2).all())
    finally:
        del p0, p1
        for c in cleanups:
            c()


def test_replicated_shared_region_is_one_slot_every_rank_reads() -> None:
    layout = make_layout(CASES["mla"], num_units=3)  # copies 1; unit 1152 B, row 4096
    (p0, p1), cleanups = shared_pools(layout, replicated=True)
    try:
        assert p0.shape == (3, 1152) and p0.stride() == (4096, 1)
        data = rand_int8(torch.Generator().manual_seed(2), 3, 1152)
        p0.copy_(data)  # rank 0 writes
        assert torch.equal(p1, data)  # rank 1 reads the same bytes
    finally:
        del p0, p1
        for c in cleanups:
            c()
