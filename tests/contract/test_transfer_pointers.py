"""The pointer arrays the CUDA path hands to vLLM's batched memcpy, executed on CPU memory.

On CUDA the worker turns each copy plan into (src_ptrs, dst_ptrs, sizes) with
``copy_pointers`` and passes them to ``swap_blocks_batch`` (``cuMemcpyBatchAsync``).
No GPU runs here, so this test builds exactly those arrays for CPU tensors and runs
them with ``ctypes.memmove``, one entry at a time, as the driver would. For every
architecture of the offloader contract tests (vLLM's own KV-cache layout, from
:class:`~.offload_loop.EngineLoop`) and both directions it checks that:

- the pointer copies leave every byte of the KV backing and of the pool buffer
  exactly as the piecewise path (the worker's CPU ``submit_store``/``submit_load``)
  does;
- both equal an oracle written from the layout definition (``host_layout.py``), not
  from the planner, so a planner bug cannot hide behind two paths sharing it;
- no entry reaches outside its tensor's storage, past the page of its block, past its
  unit in the pool slot, or writes a destination byte twice.
"""

from __future__ import annotations

import ctypes
import json
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from spillway_engine.offloader.copy_plan import CopyPlan, copy_pointers
from spillway_engine.offloader.geometry import unpadded_page_bytes
from spillway_engine.offloader.host_layout import HostLayout
from spillway_engine.offloader.worker import SpillwayHostWorker

from .offload_loop import EngineLoop
from .test_offloader_contract import ARCHS, Arch

# --------------------------------------------------------------------------- layouts


@dataclass
class ArchKV:
    """One architecture's KV caches as vLLM lays them out, over one int8 backing."""

    name: str
    layout: HostLayout  # the connector's, num_units replaced per test
    backing: torch.Tensor
    tensors: list[torch.Tensor]
    #: per offloaded group: (tensor index, unpadded page bytes) per layer
    refs: list[list[tuple[int, int]]]

    def caches(self) -> CanonicalKVCaches:
        return CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors],
            [[CanonicalKVCacheRef(t, p) for t, p in g] for g in self.refs],
        )


@pytest.fixture(scope="module", params=ARCHS, ids=str)
def arch_kv(request: pytest.FixtureRequest) -> ArchKV:
    arch: Arch = request.param
    # a small pool: the test builds its own; only the tensors and the layout are kept
    loop = EngineLoop(arch.config(), arch.case(), arch.backend, extra={"cpu_bytes_to_use": 1 << 26})
    kv = loop.kv_cache_config
    refs = [
        [
            (loop._layer_tensor[name], unpadded_page_bytes(loop._layer_spec[name]))
            for name in kv.kv_cache_groups[gid].layer_names
        ]
        for gid in loop.offloaded_groups
    ]
    gen = torch.Generator().manual_seed(zlib.crc32(arch.name.encode()))
    loop._backing.copy_(torch.randint(-128, 128, loop._backing.shape, generator=gen).to(torch.int8))
    return ArchKV(arch.name, loop.connector.geometry.layout, loop._backing, loop.tensors, refs)


# --------------------------------------------------------------------------- transfers

#: (kind, pool): which blocks move, and whether the pool is a private tensor or rank
#: 1's slot of a two-copy shared region (strided unit rows)
CASES = [("whole_chunks", "private"), ("partial_chunks", "slot"), ("sparse", "private")]


def block_ranges(kind: str, layout: HostLayout) -> list[tuple[int, int]]:
    """(first logical block, count) per offloaded group."""
    out = []
    for i, g in enumerate(layout.groups):
        b = g.blocks_per_chunk
        if kind == "whole_chunks":  # two whole chunks (several units each where units > 1)
            out.append((0, 2 * b))
        elif kind == "partial_chunks":  # starts and ends inside a chunk, three chunks
            out.append((b // 2 + 1, 2 * b - 1) if b > 1 else (1, 2))
        else:  # one block at the end of a chunk in even groups, nothing in odd ones
            out.append((b - 1 + b * (i % 3), 1) if i % 2 == 0 else (0, 0))
    return out


@dataclass
class Transfer:
    gpu: GPULoadStoreSpec
    units: CPULoadStoreSpec
    #: per group: logical block -> GPU block id, chunk ordinal -> its unit ids
    blocks: list[dict[int, int]]
    chunk_units: list[dict[int, list[int]]]
    num_units: int


def choose(kv: ArchKV, kind: str, rng: np.random.Generator) -> Transfer:
    layout = kv.layout
    ranges = block_ranges(kind, layout)
    num_blocks = kv.tensors[0].shape[0]
    # groups overlay the same tensors: every block id belongs to one group (0 is vLLM's
    # null block)
    ids = iter(rng.permutation(np.arange(1, num_blocks)).tolist())
    blocks = [{first + k: next(ids) for k in range(n)} for first, n in ranges]
    chunks = [
        sorted({b // g.blocks_per_chunk for b in bl})
        for g, bl in zip(layout.groups, blocks, strict=True)
    ]
    num_units = sum(len(c) * g.units for c, g in zip(chunks, layout.groups, strict=True)) + 5
    unit_ids = iter(rng.permutation(num_units).tolist())  # 5 units stay unnamed
    chunk_units = [
        {c: [next(unit_ids) for _ in range(g.units)] for c in cs}
        for cs, g in zip(chunks, layout.groups, strict=True)
    ]
    gpu_ids = [gid for bl in blocks for gid in bl.values()]
    named = [u for cu in chunk_units for c in sorted(cu) for u in cu[c]]
    gpu = GPULoadStoreSpec(
        gpu_ids, group_sizes=[n for _, n in ranges], block_indices=[f for f, _ in ranges]
    )
    return Transfer(gpu, CPULoadStoreSpec(named), blocks, chunk_units, num_units)


def make_pool(
    layout: HostLayout, pool_kind: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool view the worker gets, the whole buffer behind it)."""
    copies = 2 if pool_kind == "slot" else 1
    buf = torch.randint(
        -128, 128, (layout.num_units, copies * layout.unit_bytes), generator=gen, dtype=torch.int8
    )
    return buf[:, (copies - 1) * layout.unit_bytes :], buf


# --------------------------------------------------------------------------- oracle


def oracle_index(
    kv: ArchKV, layout: HostLayout, host_row: int, host_skip: int, t: Transfer
) -> tuple[np.ndarray, np.ndarray]:
    """(backing byte, pool-buffer byte) pairs every moved byte connects, from the
    layout's definition: per layer ref in order, per block of the chunk in order, the
    ref's unpadded page; stream byte o in unit o // unit_bytes at o % unit_bytes."""
    gpu_idx, host_idx = [], []
    for g, refs, bl, cu in zip(layout.groups, kv.refs, t.blocks, t.chunk_units, strict=True):
        bpc, ub = g.blocks_per_chunk, layout.unit_bytes
        start = 0  # stream offset of this ref's first page
        for tensor, page in refs:
            view = kv.tensors[tensor]
            for logical, block in bl.items():
                o = start + (logical % bpc) * page + np.arange(page)
                units = np.asarray(cu[logical // bpc])[o // ub]
                host_idx.append(units * host_row + host_skip + o % ub)
                gpu_idx.append(view.storage_offset() + block * view.stride(0) + np.arange(page))
            start += page * bpc
    if not gpu_idx:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(gpu_idx), np.concatenate(host_idx)


# --------------------------------------------------------------------------- pointers


def check_bounds(
    plan: CopyPlan,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    kv: ArchKV,
    pool: torch.Tensor,
    layout: HostLayout,
) -> None:
    """Every entry stays inside one page of its tensor and inside one unit of the slot."""
    src, dst, sizes = arrays
    assert len(src) == len(dst) == len(sizes) == len(plan)
    assert src.dtype == dst.dtype == sizes.dtype == np.int64
    assert (sizes > 0).all()
    gpu, host = (src, dst) if plan.store else (dst, src)

    storage = kv.backing.untyped_storage()
    lo = storage.data_ptr()
    assert (gpu >= lo).all() and (gpu + sizes <= lo + storage.nbytes()).all()
    t = plan.tensor_idx
    bases = np.array([x.data_ptr() for x in kv.tensors], dtype=np.int64)[t]
    rows = np.array([x.stride(0) for x in kv.tensors], dtype=np.int64)[t]
    pages = np.array([x.shape[1] for x in kv.tensors], dtype=np.int64)[t]
    blocks = np.array([x.shape[0] for x in kv.tensors], dtype=np.int64)[t]
    rel = gpu - bases
    assert (rel >= 0).all(), "before the tensor's first block"
    assert (rel + sizes <= (blocks - 1) * rows + pages).all(), "past the tensor's last page"
    # a piece may run over several blocks (coalesced adjacent rows) only where the
    # rows have no padding between pages
    within_page = rel % rows + sizes <= pages
    assert (within_page | (pages == rows)).all(), "past the end of a block's page"

    pstore = pool.untyped_storage()
    lo = pstore.data_ptr()
    assert (host >= lo).all() and (host + sizes <= lo + pstore.nbytes()).all()
    rel = host - pool.data_ptr()
    row = pool.stride(0)
    last = (layout.num_units - 1) * row + layout.unit_bytes
    assert (rel >= 0).all() and (rel + sizes <= last).all(), "outside the pool"
    # across units (adjacent ones, coalesced) only where no other slot lies between
    within_unit = rel % row + sizes <= layout.unit_bytes
    assert (within_unit | (row == layout.unit_bytes)).all(), "past the end of a unit"

    order = np.argsort(dst, kind="stable")
    d, n = dst[order], sizes[order]
    assert (d[:-1] + n[:-1] <= d[1:]).all(), "a destination byte is written twice"


def memmove_all(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """What cuMemcpyBatchAsync does with the arrays, on host memory."""
    for s, d, n in zip(*(a.tolist() for a in arrays), strict=True):
        ctypes.memmove(d, s, n)


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize(("kind", "pool_kind"), CASES, ids=[k for k, _ in CASES])
def test_pointer_arrays_copy_what_the_piecewise_path_copies(
    arch_kv: ArchKV, kind: str, pool_kind: str, store: bool
) -> None:
    seed = zlib.crc32(f"{arch_kv.name}/{kind}/{store}".encode())
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    t = choose(arch_kv, kind, rng)
    layout = replace(arch_kv.layout, num_units=t.num_units)
    pool, buf = make_pool(layout, pool_kind, gen)
    worker = SpillwayHostWorker(arch_kv.caches(), layout, pool)
    backing0, buf0 = arch_kv.backing.clone(), buf.clone()

    # the piecewise path, through the worker's own (CPU) submit
    if store:
        assert worker.submit_store(1, t.gpu, t.units)
    else:
        assert worker.submit_load(1, t.units, t.gpu)
    (result,) = worker.get_finished()
    piecewise = arch_kv.backing.clone(), buf.clone()
    arch_kv.backing.copy_(backing0)
    buf.copy_(buf0)

    # the CUDA path's arrays, from the same plan and the same base addresses
    plan = worker.plan(t.gpu, t.units, store)
    arrays = copy_pointers(plan, *worker.pointer_bases())
    check_bounds(plan, arrays, arch_kv, pool, layout)
    memmove_all(arrays)
    assert int(arrays[2].sum()) == plan.num_bytes == result.transfer_size > 0

    assert torch.equal(arch_kv.backing, piecewise[0]), "KV caches differ from the piecewise path"
    assert torch.equal(buf, piecewise[1]), "pool differs from the piecewise path"

    # both against the layout's definition; the read side is untouched
    host_skip = layout.unit_bytes if pool_kind == "slot" else 0
    gpu_idx, host_idx = oracle_index(arch_kv, layout, buf.stride(0), host_skip, t)
    assert plan.num_bytes == len(gpu_idx)
    want_kv, want_buf = backing0.numpy().copy(), buf0.numpy().reshape(-1).copy()
    if store:
        want_buf[host_idx] = want_kv[gpu_idx]
    else:
        want_kv[gpu_idx] = want_buf[host_idx]
    np.testing.assert_array_equal(buf.numpy().reshape(-1), want_buf)
    np.testing.assert_array_equal(arch_kv.backing.numpy(), want_kv)
    arch_kv.backing.copy_(backing0)  # the next case starts from the same caches
    worker.shutdown()


# --------------------------------------------------------------------------- the GPU check

# e2e/gpu/transfer_check.py (torch + cuda-bindings on the GPU machine): everything but
# the CUDA lanes and cuMemcpyBatchAsync runs here, on CPU tensors with memmove.


def _transfer_check():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "e2e" / "gpu" / "transfer_check.py"
    spec = importlib.util.spec_from_file_location("transfer_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tc = _transfer_check()


def test_gpu_check_layouts_are_the_planners() -> None:
    full = {n: tc.model_kv(n, tc.load_config(f)) for n, f in tc.MODELS.items()}
    # the saved copy for machines without pydantic must be make_plan's
    saved = json.loads(tc.LAYOUTS_FILE.read_text())
    assert saved == {n: json.loads(json.dumps(tc.kv_to_dict(kv))) for n, kv in full.items()}, (
        "run `python e2e/gpu/transfer_check.py --write-layouts`"
    )
    gemma, qwen, llama = full["gemma-3-27b"], full["qwen3-next-80b"], full["llama-3.1-70b"]
    assert len(gemma.layout.groups) == 7 and len(gemma.tensor_pages) == 10
    assert [g.units for g in gemma.layout.groups] == [9, 9, 9, 9, 8, 8, 10]
    # three GDN groups whose unpadded pages are shorter than the unified page
    assert len(qwen.layout.groups) == 4 and len(qwen.tensor_pages) == 12
    assert [r[0][1] < qwen.tensor_pages[0] for r in qwen.refs] == [True, True, True, False]
    assert len(llama.layout.groups) == 1 and len(llama.tensor_pages) == 80


@pytest.mark.parametrize("model", list(tc.MODELS))
def test_gpu_check_round_trips_on_cpu(model: str) -> None:
    kv = tc.model_kv(model, tc.shrink(tc.load_config(tc.MODELS[model]), 12))
    res = tc.check_model(
        kv, 3 * kv.chunk_set_bytes, 2, ["random", "sequential"], "cpu", tc.memmove_memcpy
    )
    assert res.problems == []
    assert {(r.ids, r.direction) for r in res.rows} == {
        (i, d) for i in ("random", "sequential") for d in ("store", "load")
    }
    assert all(r.jobs == 2 and r.descriptors > 0 and r.gbps > 0 for r in res.rows)
    by = {(r.ids, r.direction): r.descriptors for r in res.rows}
    assert by["sequential", "store"] < by["random", "store"]  # adjacent blocks coalesce


def test_gpu_check_catches_a_dropped_copy() -> None:
    kv = tc.model_kv("qwen3-next-80b", tc.shrink(tc.load_config(tc.MODELS["qwen3-next-80b"]), 8))

    def lossy(src, dst, sizes, is_src_access_order_any=False):
        tc.memmove_memcpy(src[1:], dst[1:], sizes[1:])

    res = tc.check_model(kv, kv.chunk_set_bytes, 1, ["random"], "cpu", lossy)
    assert any("loaded pages differ" in p for p in res.problems)


def test_gpu_check_exits_3_with_one_line_without_a_gpu(tmp_path, capsys) -> None:
    assert tc.main(["--json", str(tmp_path / "r.json")]) == tc.EXIT_MISSING
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("transfer-check: cannot run: no CUDA GPU")
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "missing"
