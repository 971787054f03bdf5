"""GPU check of Spillway's transfer path alone: torch + cuda-bindings, no vLLM.

For Gemma-3-27B (7 KV groups), Qwen3-Next-80B (3 GDN + 1 attention group) and
Llama-3.1-70B (1 group), on one rank, the planner (``make_plan`` over
tests/fixtures/models) gives the groups, page bytes and pool units. The script then
allocates the GPU KV tensors as vLLM's offloading layout has them (one int8 tensor
per shared layer slot, ``(num_blocks, page)`` rows) and a pinned host pool, and runs
the worker's own CUDA path: ``plan_copies`` -> ``copy_pointers`` -> ``CudaLane``
(dedicated streams, timing events) with ``cuMemcpyBatchAsync`` from cuda-bindings in
place of vLLM's ``swap_blocks_batch`` (same pointer arrays, same access-order flag).

Per model and block-id pattern (``random``: scattered blocks as after churn, one
descriptor per page piece; ``sequential``: adjacent blocks that coalesce): store
every job, then load every job into other blocks, and check byte for byte that the
loaded pages equal the stored ones and that the padding behind unpadded (GDN) pages
is untouched. One extra job with partial chunks is loaded once through the batched
path and once piece by piece (``copy_pieces``) and both must agree. GB/s per
direction = bytes / (first job's start event -> last job's end event), against PCIe
Gen5 x16 (~63 GB/s per direction).

    python e2e/gpu/transfer_check.py [--gib 4] [--models gemma-3-27b,...] [--json PATH]

Writes the table to stdout and ``$OUT/transfer-check.json`` (or ``--json``). Exit 0:
every round trip exact; 1: a byte differed; 3: torch/CUDA/cuda-bindings missing (one
line says which). See e2e/gpu/README.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "engine") not in sys.path:
    sys.path.insert(0, str(REPO / "engine"))

#: short name -> fixture under tests/fixtures/models
MODELS = {
    "gemma-3-27b": "gemma-3-27b-it",
    "qwen3-next-80b": "qwen3-next-80b-a3b-instruct",
    "llama-3.1-70b": "llama-3.1-70b-instruct",
}
PCIE_GEN5_X16_GBPS = 63.0
EXIT_MISSING = 3


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ModelKV:
    """One rank's offloaded KV as the planner sees it, in the worker's terms."""

    name: str
    layout: Any  # HostLayout (num_units set per run)
    #: padded page bytes of each GPU tensor (one tensor per shared layer slot)
    tensor_pages: tuple[int, ...]
    #: per offloaded group: (tensor index, unpadded page bytes) per layer
    refs: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def chunk_set_bytes(self) -> int:
        return sum(g.chunk_bytes for g in self.layout.groups)


def load_config(fixture: str) -> dict[str, Any]:
    path = REPO / "tests" / "fixtures" / "models" / f"{fixture}.json"
    return json.loads(path.read_text())["config"]


def model_kv(name: str, config: dict[str, Any], gpu: str = "h200") -> ModelKV:
    """Groups, pages and units from the planner (pure: no vLLM, no device)."""
    from spillway_engine.offloader.host_layout import HostLayout
    from spillway_engine.planner.plan import PlanRequest, make_plan

    plan = make_plan(config, PlanRequest(model_name=name, gpu=gpu, cpu_memory_bytes=1 << 30))
    layout = HostLayout.from_plan(plan)
    assert layout.copies == 1, "one rank"
    # every group offloaded, in order: the refs below are per group position
    assert [g.group_id for g in layout.groups] == list(range(len(plan.kv_groups))), name
    refs = []
    # vLLM's hybrid allocation: layer i of every group shares tensor i (so the number
    # of tensors is the largest group, padding layers included), pages unified
    num_tensors = max(g.num_layers + g.padded_layers for g in plan.kv_groups)
    for g, c in zip(plan.kv_groups, layout.groups, strict=True):
        page = c.chunk_bytes // (g.num_layers * c.blocks_per_chunk)  # unpadded (GDN)
        assert page * g.num_layers * c.blocks_per_chunk == c.chunk_bytes, g
        refs.append(tuple((i, page) for i in range(g.num_layers)))
    pages = {g.page_bytes for g in plan.kv_groups}
    assert len(pages) == 1, f"{name}: pages not unified: {pages}"
    return ModelKV(name, layout, (pages.pop(),) * num_tensors, tuple(refs))


#: the planner's layouts of MODELS, for a machine without pydantic (the planner's one
#: dependency beyond the standard library); a contract test keeps it equal to make_plan
LAYOUTS_FILE = Path(__file__).with_name("transfer_layouts.json")


def kv_to_dict(kv: ModelKV) -> dict[str, Any]:
    return {
        "layout": asdict(kv.layout),
        "tensor_pages": list(kv.tensor_pages),
        "refs": [[list(r) for r in g] for g in kv.refs],
    }


def kv_from_dict(name: str, d: dict[str, Any]) -> ModelKV:
    from spillway_engine.offloader.host_layout import GroupSlots, HostLayout

    lay = dict(d["layout"])
    lay["groups"] = tuple(GroupSlots(**g) for g in lay["groups"])
    refs = tuple(tuple((t, p) for t, p in g) for g in d["refs"])
    return ModelKV(name, HostLayout(**lay), tuple(d["tensor_pages"]), refs)


def planned_kv(name: str) -> tuple[ModelKV, str]:
    """(layout, where it came from): the planner, or its saved output without pydantic."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        saved = json.loads(LAYOUTS_FILE.read_text())[name]
        return kv_from_dict(name, saved), f"{LAYOUTS_FILE.name} (no pydantic here)"
    return model_kv(name, load_config(MODELS[name])), "make_plan"


def shrink(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """Fewer layers, same group structure (for CPU tests of this script)."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    return config


# --------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One transfer: per group, logical blocks -> src (stored) / dst (loaded) ids."""

    ranges: list[tuple[int, int]]  # per group (first logical block, count)
    src: list[list[int]]
    dst: list[list[int]]
    units: list[int]  # per group, per chunk touched, that group's unit ids
    num_bytes: int = 0

    def specs(self, load: bool) -> tuple[Any, Any]:
        import numpy as np

        from spillway_engine.offloader.copy_plan import Blocks

        ids = self.dst if load else self.src
        gpu = Blocks(
            np.asarray([b for g in ids for b in g], dtype=np.int64),
            [n for _, n in self.ranges],
            [f for f, _ in self.ranges],
        )
        return gpu, Blocks(np.asarray(self.units, dtype=np.int64))


def make_jobs(
    kv: ModelKV, chunks: int, chunks_per_job: int, pattern: str, seed: int = 0
) -> tuple[list[Job], Job, int, int]:
    """Timed jobs (whole chunks), one partial-chunk job, blocks and units needed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    groups = kv.layout.groups
    sizes = [chunks_per_job] * (chunks // chunks_per_job)
    if chunks % chunks_per_job:
        sizes.append(chunks % chunks_per_job)
    # the partial job: starts and ends inside a chunk where a chunk has several blocks
    partial = [
        (b // 2 + 1, 2 * b - 1) if b > 1 else (0, 2) for b in (g.blocks_per_chunk for g in groups)
    ]
    ranges = [[(0, n * g.blocks_per_chunk) for g in groups] for n in sizes] + [partial]
    blocks_needed = 2 * sum(n for job in ranges for _, n in job)
    chunk_counts = [
        [
            -(-(f % g.blocks_per_chunk + n) // g.blocks_per_chunk) if n else 0
            for (f, n), g in zip(job, groups, strict=True)
        ]
        for job in ranges
    ]
    units_needed = sum(c * g.units for cs in chunk_counts for c, g in zip(cs, groups, strict=True))
    # every block id belongs to one group and one job; 0 stays unused (vLLM's null)
    block_ids = np.arange(1, blocks_needed + 1)
    if pattern == "random":
        block_ids = rng.permutation(block_ids)
    unit_ids = rng.permutation(units_needed) if pattern == "random" else np.arange(units_needed)
    bi, ui = iter(block_ids.tolist()), iter(unit_ids.tolist())
    jobs = []
    for job, cs in zip(ranges, chunk_counts, strict=True):
        src = [[next(bi) for _ in range(n)] for _, n in job]
        dst = [[next(bi) for _ in range(n)] for _, n in job]
        units = [next(ui) for c, g in zip(cs, groups, strict=True) for _ in range(c * g.units)]
        nbytes = sum(n * sum(p for _, p in r) for (_, n), r in zip(job, kv.refs, strict=True))
        jobs.append(Job(list(job), src, dst, units, nbytes))
    return jobs[:-1], jobs[-1], blocks_needed + 1, units_needed


# --------------------------------------------------------------------------- execution


@dataclass
class Rig:
    kv: ModelKV
    layout: Any
    tensors: list[Any]
    pool: Any
    gpu_flat: list[Any]
    pool_flat: Any

    @property
    def bases(self) -> tuple[list[int], int]:
        return [f.data_ptr() for f in self.gpu_flat], self.pool_flat.data_ptr()

    def plan(self, job: Job, store: bool) -> Any:
        from spillway_engine.offloader.copy_plan import Ref, plan_copies

        gpu, units = job.specs(load=not store)
        refs = [[Ref(t, p) for t, p in g] for g in self.kv.refs]
        rows = [t.stride(0) for t in self.tensors]
        return plan_copies(self.layout, refs, gpu, units, store=store, gpu_row_bytes=rows)


def build_rig(kv: ModelKV, num_blocks: int, num_units: int, device: Any, pin: bool) -> Rig:
    import torch

    from spillway_engine.offloader.copy_plan import check_layout_agreement, flat_bytes

    layout = replace(kv.layout, num_units=num_units)
    tensors = []
    for page in kv.tensor_pages:
        t = torch.empty((num_blocks, page), dtype=torch.int8, device=device)
        t.random_(-128, 128)
        tensors.append(t)
    pool = torch.empty((num_units, layout.unit_bytes), dtype=torch.int8, pin_memory=pin)
    from spillway_engine.offloader.copy_plan import Ref

    check_layout_agreement(layout, [[Ref(t, p) for t, p in g] for g in kv.refs])
    gpu_flat = [flat_bytes(t, num_blocks, t.stride(0), t.shape[1]) for t in tensors]
    pool_flat = flat_bytes(pool, num_units, layout.unit_bytes, layout.unit_bytes)
    return Rig(kv, layout, tensors, pool, gpu_flat, pool_flat)


def memmove_memcpy(src: Any, dst: Any, sizes: Any, is_src_access_order_any: bool = False) -> None:
    """The batched memcpy on host memory (CPU tests of this script)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def cuda_bindings_memcpy() -> Callable[..., None]:
    """``cuMemcpyBatchAsync`` on the current torch stream, as vLLM's op calls it."""
    import torch
    from cuda.bindings import driver

    order = driver.CUmemcpySrcAccessOrder
    attrs = {}
    for any_order in (False, True):
        a = driver.CUmemcpyAttributes()
        a.srcAccessOrder = (
            order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            if any_order
            else order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        )
        attrs[any_order] = a

    def memcpy(src: Any, dst: Any, sizes: Any, is_src_access_order_any: bool = False) -> None:
        n = int(sizes.numel())
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        res = driver.cuMemcpyBatchAsync(
            [driver.CUdeviceptr(p) for p in dst.tolist()],
            [driver.CUdeviceptr(p) for p in src.tolist()],
            sizes.tolist(),
            n,
            [attrs[bool(is_src_access_order_any)]],
            [0],
            1,
            stream,
        )
        # 12.x bindings also return failIdx: (err, failIdx); 13.x: (err,)
        err = res[0] if isinstance(res, tuple) else res
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {err!r} ({n} copies)")

    return memcpy


def run_jobs(
    rig: Rig, jobs: Sequence[Job], store: bool, memcpy: Callable[..., None], lane: Any | None
) -> tuple[float, int, list[float]]:
    """Submit every job on ``lane`` (CUDA) or run it at once (CPU); returns (seconds
    from the first start to the last end, descriptors, per-job seconds)."""
    from spillway_engine.offloader.cuda_lanes import batched_copy

    plans = [rig.plan(j, store) for j in jobs]
    for plan, job in zip(plans, jobs, strict=True):
        assert plan.num_bytes == job.num_bytes, (plan.num_bytes, job.num_bytes)
    descriptors = sum(len(p) for p in plans)
    gpu_bases, host_base = rig.bases

    def copy(plan: Any) -> tuple[Any, ...]:
        return batched_copy(plan, gpu_bases, host_base, memcpy)

    if lane is None:
        t0 = time.perf_counter()
        for plan in plans:
            copy(plan)
        return time.perf_counter() - t0, descriptors, []
    first_start = None
    for i, plan in enumerate(plans):
        lane.submit(i, plan, copy)
        if first_start is None:
            first_start = lane.pending[-1].start
    last_end = lane.pending[-1].end
    last_end.synchronize()
    total = first_start.elapsed_time(last_end) * 1e-3
    per_job = [r.seconds for r in lane.finished()]
    return total, descriptors, per_job


def check_round_trip(rig: Rig, jobs: Sequence[Job], saved_padding: dict) -> list[str]:
    """Loaded pages equal the stored ones; padding behind unpadded pages untouched."""
    import torch

    problems = []
    for j, job in enumerate(jobs):
        for g, refs in enumerate(rig.kv.refs):
            if not job.src[g]:
                continue
            src = torch.tensor(job.src[g], device=rig.tensors[0].device)
            dst = torch.tensor(job.dst[g], device=rig.tensors[0].device)
            for t, page in refs:
                tensor = rig.tensors[t]
                if not torch.equal(tensor[dst, :page], tensor[src, :page]):
                    problems.append(f"job {j} group {g} tensor {t}: loaded pages differ")
                key = (j, g, t)
                if key in saved_padding and not torch.equal(tensor[dst, page:], saved_padding[key]):
                    problems.append(f"job {j} group {g} tensor {t}: padding changed")
    return problems


def save_padding(rig: Rig, jobs: Sequence[Job]) -> dict:
    import torch

    out = {}
    for j, job in enumerate(jobs):
        for g, refs in enumerate(rig.kv.refs):
            if not job.dst[g]:
                continue
            dst = torch.tensor(job.dst[g], device=rig.tensors[0].device)
            for t, page in refs:
                if page < rig.tensors[t].shape[1]:
                    out[j, g, t] = rig.tensors[t][dst, page:].clone()
    return out


@dataclass
class Row:
    model: str
    ids: str
    direction: str
    jobs: int
    gib: float
    descriptors: int
    seconds: float
    gbps: float
    pcie_fraction: float
    median_job_gbps: float | None
    chunk_tokens: int
    groups: int
    unit_bytes: int


@dataclass
class ModelResult:
    model: str
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def check_model(
    kv: ModelKV,
    target_bytes: int,
    chunks_per_job: int,
    patterns: Sequence[str],
    device: Any,
    memcpy: Callable[..., None],
    repeats: int = 3,
) -> ModelResult:
    import torch

    from spillway_engine.offloader.copy_plan import copy_pieces

    cuda = torch.device(device).type == "cuda"
    result = ModelResult(kv.name)
    t_model = time.perf_counter()
    chunks = max(1, -(-target_bytes // kv.chunk_set_bytes))
    for pattern in patterns:
        jobs, partial, num_blocks, num_units = make_jobs(kv, chunks, chunks_per_job, pattern)
        rig = build_rig(kv, num_blocks, num_units, device, pin=cuda)
        lanes = {}
        if cuda:
            from spillway_engine.offloader.cuda_lanes import CudaLane

            lanes = {d: CudaLane(torch.device(device)) for d in ("store", "load")}
            torch.cuda.synchronize()
        padding = save_padding(rig, [*jobs, partial])
        best: dict[str, tuple[float, int, list[float]]] = {}
        for _ in range(repeats if cuda else 1):
            for direction, store in (("store", True), ("load", False)):
                out = run_jobs(rig, jobs, store, memcpy, lanes.get(direction))
                if direction not in best or out[0] < best[direction][0]:
                    best[direction] = out
        problems = check_round_trip(rig, jobs, padding)

        # partial chunks: batched store, then a batched and a piecewise load must agree
        run_jobs(rig, [partial], True, memcpy, lanes.get("store"))
        run_jobs(rig, [partial], False, memcpy, lanes.get("load"))
        problems += check_round_trip(
            rig, [partial], {(0, *k[1:]): v for k, v in padding.items() if k[0] == len(jobs)}
        )
        # keep only the loaded rows (not whole tensors: GiBs on the GPU)
        dev = rig.tensors[0].device
        loaded = {
            (g, t, page): rig.tensors[t][torch.tensor(ids, device=dev), :page].clone()
            for g, (refs, ids) in enumerate(zip(rig.kv.refs, partial.dst, strict=True))
            if ids
            for t, page in refs
        }
        for g, t, page in loaded:  # scribble, then load piece by piece
            rig.tensors[t][torch.tensor(partial.dst[g], device=dev), :page] = 0
        plan = rig.plan(partial, store=False)
        copy_pieces(plan, rig.gpu_flat, rig.pool_flat, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        for (g, t, page), want in loaded.items():
            got = rig.tensors[t][torch.tensor(partial.dst[g], device=dev), :page]
            if not torch.equal(got, want):
                problems.append(f"group {g} tensor {t}: piecewise load differs from batched")
        result.problems += [f"{pattern}: {p}" for p in problems]

        total_bytes = sum(j.num_bytes for j in jobs)
        for direction, (seconds, desc, per_job) in best.items():
            gbps = total_bytes / seconds / 1e9 if seconds > 0 else float("inf")
            med = (
                statistics.median(j.num_bytes / s / 1e9 for j, s in zip(jobs, per_job, strict=True))
                if per_job
                else None
            )
            result.rows.append(
                Row(
                    kv.name,
                    pattern,
                    direction,
                    len(jobs),
                    round(total_bytes / 2**30, 3),
                    desc,
                    round(seconds, 6),
                    round(gbps, 2),
                    round(gbps / PCIE_GEN5_X16_GBPS, 3),
                    None if med is None else round(med, 2),
                    kv.layout.chunk_tokens,
                    len(kv.layout.groups),
                    kv.layout.unit_bytes,
                )
            )
        del rig, lanes
        if cuda:
            torch.cuda.empty_cache()
    result.seconds = round(time.perf_counter() - t_model, 2)
    return result


# --------------------------------------------------------------------------- report


def table(rows: Sequence[Row]) -> str:
    head = (
        "model",
        "ids",
        "dir",
        "jobs",
        "GiB",
        "descriptors",
        "GB/s",
        "of 63 GB/s",
        "job median GB/s",
    )
    body = [
        (
            r.model,
            r.ids,
            r.direction,
            str(r.jobs),
            f"{r.gib:.2f}",
            str(r.descriptors),
            f"{r.gbps:.1f}",
            f"{100 * r.pcie_fraction:.0f}%",
            "-" if r.median_job_gbps is None else f"{r.median_job_gbps:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in (head, *body)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def preflight() -> str | None:
    """None when torch with a CUDA GPU and cuda-bindings' cuMemcpyBatchAsync are here."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return f"cuda-bindings is not importable ({e}); it provides cuda.bindings.driver"
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        return "cuda.bindings.driver has no cuMemcpyBatchAsync (needs cuda-bindings >= 12.8)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    p.add_argument(
        "--gib", type=float, default=4.0, help="GiB moved per direction per model and pattern"
    )
    p.add_argument("--chunks-per-job", type=int, default=4)
    p.add_argument("--ids", default="random,sequential", help="block-id patterns")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (the fastest counts)")
    p.add_argument("--json", default=None, help="default: $OUT/transfer-check.json")
    p.add_argument("--write-layouts", action="store_true", help=f"write {LAYOUTS_FILE.name}, exit")
    args = p.parse_args(argv)
    if args.write_layouts:
        layouts = {n: kv_to_dict(model_kv(n, load_config(f))) for n, f in MODELS.items()}
        LAYOUTS_FILE.write_text(json.dumps(layouts, indent=1) + "\n")
        return 0

    missing = preflight()
    out_path = (
        Path(args.json) if args.json else Path(os.environ.get("OUT", ".")) / "transfer-check.json"
    )
    if missing:
        print(f"transfer-check: cannot run: {missing}", file=sys.stderr)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"status": "missing", "reason": missing}, indent=2))
        return EXIT_MISSING

    import torch

    memcpy = cuda_bindings_memcpy()
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    results = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        kv, source = planned_kv(name)
        print(f"{name}: layout from {source}", flush=True)
        res = check_model(
            kv,
            int(args.gib * 2**30),
            args.chunks_per_job,
            args.ids.split(","),
            "cuda",
            memcpy,
            args.repeats,
        )
        results.append(res)
        print(f"{name}: {res.seconds:.1f}s, {'OK' if not res.problems else 'FAIL'}", flush=True)
        for problem in res.problems[:20]:
            print(f"  {problem}", flush=True)
    rows = [r for res in results for r in res.rows]
    print(table(rows))
    ok = not any(res.problems for res in results)
    import cuda.bindings

    report = {
        "status": "pass" if ok else "fail",
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_bindings": getattr(cuda.bindings, "__version__", None),
        "pcie_gen5_x16_gbps": PCIE_GEN5_X16_GBPS,
        "seconds": round(time.perf_counter() - t0, 2),
        "rows": [asdict(r) for r in rows],
        "problems": {res.model: res.problems for res in results if res.problems},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(f"{'PASS' if ok else 'FAIL'}: report in {out_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
