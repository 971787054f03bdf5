"""Host KV capacity: Spillway's offloader against vLLM's upstream one, same engine, same work.

Run from the repository root: ``python -m bench.offload_capacity [--quick] [--arch NAME ...]``
(default: N=24 prefixes, R=4 rounds, budgets 0.5/0.6/0.7x, about 1.5 minutes on 2 cores;
``--quick``: N=6, R=3, budget 0.6x only). Exits non-zero if an architecture's verdict
fails at any budget.

Both connectors run inside ``tests.contract.offload_loop.EngineLoop``: vLLM 0.33.0's real
``Scheduler`` (KV-cache manager, GPU prefix cache) and the connector's real scheduler
side (keys, lookups, host manager, LRU, evictions) on the CPU, with ``move_bytes=False``
(upstream's worker needs CUDA; transfers are acknowledged at once, which changes no
key, hit or capacity decision). Upstream is ``OffloadingConnector`` with
``{"cpu_bytes_to_use": B, "block_size": T}`` (token-based chunks, the same span as
Spillway's); Spillway is ``SpillwayOffloadingConnector`` with
``{"cpu_bytes_to_use": B, "spillway_chunk_tokens": T}``.

Architectures: real configs from ``tests/fixtures/models`` (some cut to fewer layers,
keeping their KV-group structure) and a Gemma-4-style config built with
``transformers.Gemma4TextConfig`` whose full layer has twice the sliding layers'
head_dim, so vLLM gives its groups different tokens per block; from
``tests/contract/frontier_configs``: Gemma-4-31B (12 layers), a Qwen3.5 GDN hybrid
(8 layers) and the same with its MTP drafter (``--speculative-config method=mtp``, one
draft token: the drafter's full-attention layer joins the full group) and
DeepSeek-V3.2 (4 layers: sparse-MLA latents and lightning-indexer keys in one
mixed-page MLA group on 64-token blocks, FlashMLA's sparse backend class standing in
for FlashAttention's as in the contract tests). The attention backend is the
planner's pick (``make_plan(...).gpu.attention_backend``), as the contract tests do
(Gemma 4 on Hopper: FLASH_ATTN, FA4 with 16-token pages). ``T`` is 256 tokens, or the
model's own block where that is coarser (Qwen3-Next: 576, the GDN checkpoint grid;
Qwen3.5: 1088; Jamba: 160, two 80-token blocks).

Workload (identical for both connectors of an architecture; one seed):

* ``N`` distinct prefixes of ``P`` random tokens (``P`` a multiple of ``T``);
* ``R`` rounds; each round serves every prefix once, in a fresh seeded random order
  (no prefix twice in a row across a round boundary), each request being its prefix
  plus a distinct random suffix of 1..T/2 tokens (less than a chunk), 2 output tokens;
  requests run one after another to completion;
* the GPU KV pool (``num_gpu_blocks``) is 1.25x the blocks one request of
  ``max_model_len = P + T`` needs (vLLM's own ``max_memory_usage_bytes`` per group),
  so the GPU prefix cache holds about one request and every reuse must come from the
  host pool;
* the host budget ``B`` is a fraction (``--fractions``, default 0.5, 0.6 and 0.7) of
  what upstream needs to hold every prefix: a calibration engine with a large pool
  serves one request and counts the keys it stores (sliding-window groups store only
  the chunks their window needs, Mamba groups one state), so ``B = fraction x N x
  sum over those keys of upstream's row bytes``. Where upstream refuses the
  configuration, Spillway's own need (keys x units x unit bytes) stands in. The
  table shows 0.6x; a sweep line per budget follows it.

Columns (read off the engines at the end of the workload, unless noted):

* groups: vLLM's KV-cache groups (kind, tokens per block, true bytes per block on one
  worker: unpadded pages of the group's layers; the padded page total if it differs);
* starts: whether the connector accepts the configuration (vLLM's refusal otherwise);
* chunk span T: upstream ``tokens_per_block x blocks_per_chunk``, Spillway
  ``layout.chunk_tokens``; units/group: Spillway ``GroupSlots.units`` (and unit bytes);
* capacity: upstream ``CPUOffloadingSpec.num_chunks`` rows of ``kv_bytes_per_chunk``;
  Spillway ``layout.num_units`` units of ``unit_bytes``;
* keys held: (chunk, group) keys in the manager's cache policy;
* row utilization: sum over held keys of the key's true bytes (its group's true bytes
  per block x the group's blocks per chunk x copies) / sum of the host bytes their
  slots take (upstream: one padded row each; Spillway: ``units x unit_bytes``);
* prefix held: a probe after the workload. The host pool is frozen (the manager's
  ``prepare_store`` stores nothing) and, for each distinct prefix, the GPU prefix
  cache is emptied (``kv_cache_manager.reset_prefix_cache``) and one fresh request
  (prefix + new suffix) runs through the real scheduler; the tokens it loads from
  the host (the scheduler's connector prefix-cache hits) are summed over prefixes.
  GPU hits during the probe are checked to be zero, and the probe cannot evict;
* host hit rate: host-hit prompt tokens / prompt tokens over the workload (probe
  excluded); GPU hit rate likewise, for context.

Verdict per architecture and budget (the issue's acceptance): Spillway's row
utilization >= 95%; where upstream wastes row space (its utilization < 99.9%) Spillway
holds at least as much reusable prefix and has at least upstream's host hit rate (the
same "at least" is checked for multi-group models without waste); where upstream
refuses, Spillway runs and serves host hits; single-group models equal upstream exactly
(same chunk span, same keys held, same capacity in chunks, same prefix held and hits).

Held prefix moves in steps: vLLM's LRU evicts a prefix's chunks from its tail, and a
chunk only helps with every earlier chunk present, so a few percent more keys show
only where they complete another prefix (hence the budget sweep).
"""

from __future__ import annotations

# isort: off
import tests.contract.vllm_harness  # noqa: F401  (first: sets VLLM_TARGET_DEVICE=cpu)

# isort: on
import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_offload.base import PrepareStoreOutput, get_offload_group_idx
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from spillway_engine.arith import cdiv
from spillway_engine.offloader.geometry import spec_true_bytes_per_block
from spillway_engine.planner.offload_geometry import host_copies
from spillway_engine.planner.plan import PlanRequest, make_plan
from tests.contract.offload_loop import (
    SPILLWAY,
    UPSTREAM,
    EngineLoop,
    gemma4_style_config,
    shrunk_config,
)
from tests.contract.vllm_harness import Case, build_layout

#: the model configs the contract tests use too (data, read here, not imported from tests)
MODELS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
FRONTIER = Path(__file__).resolve().parents[1] / "tests" / "contract" / "frontier_configs"
GPU = "h100"
FALLBACK_BACKEND = "FLASH_ATTN"
UTIL_TARGET = 0.95
NO_WASTE = 0.999
GPU_MARGIN = 1.25
CALIBRATION_HEADROOM = 4
MAIN_FRACTION = 0.6
VOCAB = (100, 30_000)


# ------------------------------------------------------------------ architectures


def _shrunk(name: str, layers: int) -> Callable[[], dict[str, Any]]:
    return lambda: shrunk_config(name, layers)


def _frontier(name: str, layers: int) -> Callable[[], dict[str, Any]]:
    """A frontier fixture cut to its first ``layers`` layers (layer_types cut alike)."""

    def config() -> dict[str, Any]:
        data = json.loads((FRONTIER / f"{name}.json").read_text())["config"]
        data["num_hidden_layers"] = layers
        if isinstance(data.get("layer_types"), list):
            data["layer_types"] = data["layer_types"][:layers]
        return data

    return config


def _fixture(name: str) -> Callable[[], dict[str, Any]]:
    return lambda: json.loads((MODELS / f"{name}.json").read_text())["config"]


@dataclass(frozen=True)
class Arch:
    name: str
    what: str
    config: Callable[[], dict[str, Any]]
    chunk_tokens: int
    prefix_tokens: int
    #: draft tokens of an MTP drafter (--speculative-config method=mtp); 0: none
    mtp_tokens: int = 0


ARCHS = [
    Arch("llama-3.2-1b", "dense, 1 group", _fixture("llama-3.2-1b"), 256, 2048),
    Arch("gemma-3-1b", "SWA 5:1, 7 groups", _fixture("gemma-3-1b-it"), 256, 2048),
    Arch("gpt-oss", "SWA 1:1, 4 layers", _shrunk("gpt-oss-120b", 4), 256, 2048),
    Arch(
        "qwen3-next",
        "GDN hybrid, 8 layers",
        _shrunk("qwen3-next-80b-a3b-instruct", 8),
        576,
        1728,
    ),
    Arch("deepseek-v2-lite", "MLA, 4 layers", _shrunk("deepseek-v2-lite", 4), 256, 2048),
    Arch("gemma-4-style", "SWA 5:1, 2 block sizes", gemma4_style_config, 256, 2048),
    Arch("jamba-mini-1.5", "Mamba hybrid, 8 layers", _shrunk("jamba-mini-1.5", 8), 160, 1600),
    Arch(
        "qwen3.5",
        "GDN hybrid (Qwen3.5), 8 layers",
        _frontier("qwen3.5-35b-a3b", 8),
        1088,
        3264,
    ),
    Arch(
        "qwen3.5-mtp",
        "Qwen3.5 + MTP drafter (1 token)",
        _frontier("qwen3.5-35b-a3b", 8),
        1088,
        3264,
        mtp_tokens=1,
    ),
    Arch("gemma-4-31b", "Gemma 4 SWA 5:1, 12 layers", _frontier("gemma-4-31b", 12), 256, 2048),
    Arch(
        "deepseek-v3.2",
        "sparse MLA + indexer keys, 4 layers",
        _frontier("deepseek-v3.2-exp", 4),
        256,
        2048,
    ),
]


# ----------------------------------------------------------------------- helpers


def attention_backend(config: dict[str, Any], max_model_len: int) -> tuple[str | None, str]:
    """The planner's backend for this model on the GPU, as the contract tests pick it."""
    try:
        plan = make_plan(
            config,
            PlanRequest(
                cpu_memory_bytes=1 << 34, offloader="upstream", gpu=GPU, max_model_len=max_model_len
            ),
        )
    except Exception as e:  # the planner has no rule for this architecture
        return FALLBACK_BACKEND, f"planner: {str(e).split(';')[0]}; using {FALLBACK_BACKEND}"
    return plan.gpu.attention_backend, "planner's pick"


def cpu_workspace() -> None:
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))


def min_gpu_blocks(layout: Any) -> int:
    """GPU blocks one request of max_model_len takes, summed over groups (vLLM's sizes)."""
    vc = layout.vllm_config
    total = 0
    for group in layout.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += cdiv(spec.max_memory_usage_bytes(vc), spec.page_size_bytes)
    return total


def short(error: BaseException, limit: int = 160) -> str:
    """One line: the error type and the end of its message (where vLLM says why)."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = "..." + text[-(limit - 3) :]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@dataclass
class Workload:
    prefixes: list[list[int]]
    requests: list[list[int]]
    probes: list[list[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r) for r in self.requests)


def make_workload(n: int, rounds: int, p: int, t: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(k)]

    prefixes = [tokens(p) for _ in range(n)]
    order: list[int] = []
    for _ in range(rounds):
        perm = list(range(n))
        rng.shuffle(perm)
        if order and n > 1 and perm[0] == order[-1]:
            perm[0], perm[-1] = perm[-1], perm[0]
        order.extend(perm)
    requests = [prefixes[i] + tokens(rng.randint(1, t // 2)) for i in order]
    probes = [prefix + tokens(rng.randint(1, t // 2)) for prefix in prefixes]
    return Workload(prefixes, requests, probes)


# ---------------------------------------------------------------- engine facts


@dataclass
class Facts:
    connector: str
    starts: bool
    reason: str = ""
    chunk_tokens: int | None = None
    units: list[int] = field(default_factory=list)
    unit_bytes: int | None = None
    capacity_chunks: int | None = None
    slot_bytes: int | None = None
    keys: int = 0
    keys_per_group: dict[int, int] = field(default_factory=dict)
    true_bytes: int = 0
    held_slot_bytes: int = 0
    prefix_held: int = 0
    host_hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    prompt_tokens: int = 0
    probe_gpu_hits: int = 0

    @property
    def utilization(self) -> float | None:
        return self.true_bytes / self.held_slot_bytes if self.held_slot_bytes else None

    @property
    def hit_rate(self) -> float:
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Probe:
    """Per-key true and slot bytes, and capacity, for one connector's engine."""

    def __init__(self, loop: EngineLoop, connector: str):
        self.loop = loop
        self.connector = connector
        kv = loop.kv_cache_config
        self.true_per_block = {
            gid: spec_true_bytes_per_block(group) for gid, group in enumerate(kv.kv_cache_groups)
        }
        if connector == SPILLWAY:
            layout = loop.connector.geometry.layout
            self.layout = layout
            self.key_true = {g.group_id: g.chunk_bytes * layout.copies for g in layout.groups}
            self.key_slot = {
                g.group_id: g.units * layout.unit_bytes * layout.copies for g in layout.groups
            }
        else:
            spec = OffloadingSpecFactory.create_spec(build_offloading_config(loop.vllm_config, kv))
            self.spec = spec
            copies = host_copies(
                loop.vllm_config.parallel_config.world_size, spec.replicated_layout
            )
            bpc = spec.blocks_per_chunk
            groups = spec.config.groups
            self.tokens_per_chunk = groups[0].tokens_per_block * bpc
            self.key_true = {
                g.group_id: self.true_per_block[g.group_id] * bpc * copies for g in groups
            }
            self.key_slot = {g.group_id: spec.kv_bytes_per_chunk for g in groups}
            assert spec.num_chunks == loop.manager._num_chunks, "spec and manager disagree"

    def keys(self) -> list[Any]:
        return list(self.loop.manager._policy.chunks)

    def fill(self, facts: Facts) -> None:
        keys = self.keys()
        facts.keys = len(keys)
        per_group: dict[int, int] = {}
        for key in keys:
            gid = get_offload_group_idx(key)
            per_group[gid] = per_group.get(gid, 0) + 1
            facts.true_bytes += self.key_true[gid]
            facts.held_slot_bytes += self.key_slot[gid]
        facts.keys_per_group = dict(sorted(per_group.items()))
        if self.connector == SPILLWAY:
            layout = self.layout
            facts.chunk_tokens = layout.chunk_tokens
            facts.units = [g.units for g in layout.groups]
            facts.unit_bytes = layout.unit_bytes
            facts.capacity_chunks = layout.num_units
            facts.slot_bytes = layout.unit_bytes * layout.copies
            manager = self.loop.manager
            if keys:
                assert abs(manager.row_utilization - facts.utilization) < 1e-9, (
                    "the manager's row utilization disagrees with the keys it holds"
                )
        else:
            facts.chunk_tokens = self.tokens_per_chunk
            facts.capacity_chunks = self.spec.num_chunks
            facts.slot_bytes = self.spec.kv_bytes_per_chunk

    def host_need_per_request(self) -> int:
        """Host bytes the keys held now take (the calibration engine holds one request)."""
        return sum(self.key_slot[get_offload_group_idx(k)] for k in self.keys())


def extra_config(connector: str, budget: int, t: int) -> dict[str, Any]:
    if connector == UPSTREAM:
        return {"cpu_bytes_to_use": budget, "block_size": t}
    return {"cpu_bytes_to_use": budget, "spillway_chunk_tokens": t}


def make_loop(
    config: dict[str, Any], case: Case, backend: str | None, connector: str, budget: int, t: int
) -> EngineLoop:
    return EngineLoop(
        config,
        case,
        backend,
        connector=connector,
        extra=extra_config(connector, budget, t),
        move_bytes=False,
        max_num_seqs=1,
        max_num_batched_tokens=max(4096, case.max_model_len),
    )


def freeze_stores(loop: EngineLoop) -> None:
    """Make the host pool read-only: every store offer is declined (nothing evicted)."""

    def no_store(keys: Any, req_context: Any) -> PrepareStoreOutput:
        return PrepareStoreOutput(
            keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
        )

    loop.manager.prepare_store = no_store


def serve(loop: EngineLoop, connector: str, work: Workload) -> Facts:
    facts = Facts(connector, starts=True)
    probe = Probe(loop, connector)
    loop.run(work.requests)
    c = loop.counters
    facts.host_hit_tokens, facts.gpu_hit_tokens = c.host_hit_tokens, c.gpu_hit_tokens
    facts.prompt_tokens = c.prompt_tokens
    assert facts.prompt_tokens == work.prompt_tokens
    probe.fill(facts)
    # Probe: what the pool holds, one fresh request per prefix, no GPU help, no stores.
    freeze_stores(loop)
    keys_before = set(probe.keys())
    for prompt in work.probes:
        assert loop.scheduler.kv_cache_manager.reset_prefix_cache(), "GPU cache not idle"
        host, gpu = c.host_hit_tokens, c.gpu_hit_tokens
        loop.run([prompt])
        facts.prefix_held += c.host_hit_tokens - host
        facts.probe_gpu_hits += c.gpu_hit_tokens - gpu
    assert set(probe.keys()) == keys_before, "the probe changed the host pool"
    return facts


# ----------------------------------------------------------------------- bench


@dataclass
class Run:
    fraction: float
    budget: int
    upstream: Facts
    spillway: Facts
    checks: list[tuple[str, bool]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(passed for _, passed in self.checks)


@dataclass
class Result:
    arch: Arch
    groups: list[str]
    need: int
    need_basis: str
    gpu_blocks: int
    backend_note: str
    n: int
    rounds: int
    runs: list[Run] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(run.ok for run in self.runs)


def describe_groups(layout: Any) -> list[str]:
    out = []
    for gid, group in enumerate(layout.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__.removesuffix("Spec")
        true = spec_true_bytes_per_block(group)
        padded = spec.page_size_bytes * (
            1 if type(spec).__name__ == "UniformTypeKVCacheSpecs" else len(group.layer_names)
        )
        text = f"g{gid} {kind} x{len(group.layer_names)}: {spec.block_size} tok/blk, "
        text += f"{fmt_bytes(true)}/blk"
        if padded != true:
            text += f" (padded {fmt_bytes(padded)})"
        out.append(text)
    return out


def run_arch(arch: Arch, n: int, rounds: int, fractions: list[float], seed: int) -> Result:
    t, p = arch.chunk_tokens, arch.prefix_tokens
    assert p % t == 0
    config = arch.config()
    max_len = p + t
    backend, backend_note = attention_backend(config, max_len)
    if backend and backend.endswith("MLA_SPARSE"):
        cpu_workspace()  # FlashMLA's sparse impl (the stand-in) reserves one when built
    drafter = (
        {"speculative_method": "mtp", "num_speculative_tokens": arch.mtp_tokens}
        if arch.mtp_tokens
        else {}
    )
    layout = build_layout(
        config, Case(arch.name, gpu=GPU, max_model_len=max_len, **drafter), backend
    )
    gpu_blocks = math.ceil(GPU_MARGIN * min_gpu_blocks(layout))
    case = Case(arch.name, gpu=GPU, max_model_len=max_len, num_gpu_blocks=gpu_blocks, **drafter)
    work = make_workload(n, rounds, p, t, seed)

    # Calibration: a large pool, one request; its keys x slot bytes is one prefix's need.
    groups = layout.kv_cache_config.kv_cache_groups
    per_chunk = max(spec_true_bytes_per_block(g) * t // g.kv_cache_spec.block_size for g in groups)
    calib_budget = CALIBRATION_HEADROOM * (max_len // t + 1) * len(groups) * (per_chunk + 8192)
    upstream_error: BaseException | None = None
    try:
        calib = make_loop(config, case, backend, UPSTREAM, calib_budget, t)
        calib_connector, basis = UPSTREAM, "upstream"
    except (AssertionError, ValueError) as e:
        upstream_error = e
        calib = make_loop(config, case, backend, SPILLWAY, calib_budget, t)
        calib_connector, basis = SPILLWAY, "Spillway's; upstream refuses"
    calib.run([work.prefixes[0] + [VOCAB[0]]])
    need = Probe(calib, calib_connector).host_need_per_request()
    assert need > 0, "the calibration request stored nothing"
    result = Result(
        arch,
        describe_groups(layout),
        need,
        basis,
        gpu_blocks,
        f"{backend} ({backend_note})",
        n,
        rounds,
    )

    for fraction in fractions:
        budget = int(fraction * n * need)
        if upstream_error is None:
            loop = make_loop(config, case, backend, UPSTREAM, budget, t)
            upstream = serve(loop, UPSTREAM, work)
        else:
            sizes = sorted({g.kv_cache_spec.block_size for g in groups})
            reason = f"groups have {sizes}-token blocks; vLLM: {short(upstream_error)}"
            upstream = Facts(UPSTREAM, starts=False, reason=reason)
        try:
            loop = make_loop(config, case, backend, SPILLWAY, budget, t)
        except Exception as e:  # reported as a failed verdict, not a crash
            spillway = Facts(SPILLWAY, starts=False, reason=short(e))
        else:
            spillway = serve(loop, SPILLWAY, work)
        run = Run(fraction, budget, upstream, spillway)
        run.checks = verdict(run, single_group=len(groups) == 1)
        result.runs.append(run)
    return result


def verdict(run: Run, *, single_group: bool) -> list[tuple[str, bool]]:
    up, sp = run.upstream, run.spillway
    checks: list[tuple[str, bool]] = [("Spillway starts", sp.starts)]
    if not sp.starts:
        return checks
    util = sp.utilization
    checks.append((f"Spillway row utilization {pct(util)} >= 95%", (util or 0) >= UTIL_TARGET))
    checks.append(("probes saw no GPU hits", sp.probe_gpu_hits == 0 and up.probe_gpu_hits == 0))
    if not up.starts:
        checks.append(("upstream refuses, Spillway serves host hits", sp.host_hit_tokens > 0))
        return checks
    if single_group:
        checks.append(("same chunk span", sp.chunk_tokens == up.chunk_tokens))
        checks.append(("same keys held", sp.keys == up.keys))
        checks.append(("same capacity in chunks", sp.capacity_chunks == up.capacity_chunks))
        checks.append(("same prefix held", sp.prefix_held == up.prefix_held))
        checks.append(("same host hits", sp.host_hit_tokens == up.host_hit_tokens))
    else:
        why = "upstream wastes rows" if (up.utilization or 1.0) < NO_WASTE else "no waste"
        checks.append((f"{why}: prefix held >= upstream's", sp.prefix_held >= up.prefix_held))
        checks.append(
            (f"{why}: host hit rate >= upstream's", sp.host_hit_tokens >= up.host_hit_tokens)
        )
    return checks


def column(f: Facts, what: str, total_prefix: int) -> str:
    if not f.starts:
        return "no (see below)" if what == "starts" else "-"
    if what == "starts":
        return "yes"
    if what == "span":
        return f"{f.chunk_tokens} tok"
    if what == "units":
        if f.connector == UPSTREAM:
            return "1 row per key"
        return f"{','.join(map(str, f.units))} (unit {fmt_bytes(f.unit_bytes or 0)})"
    if what == "capacity":
        kind = "rows" if f.connector == UPSTREAM else "units"
        return f"{f.capacity_chunks} {kind} x {fmt_bytes(f.slot_bytes or 0)}"
    if what == "keys":
        groups = " ".join(f"{g}:{k}" for g, k in f.keys_per_group.items())
        return f"{f.keys} [{groups}]"
    if what == "util":
        return pct(f.utilization)
    if what == "held":
        return f"{f.prefix_held} tok ({pct(f.prefix_held / total_prefix)})"
    if what == "hits":
        return f"{pct(f.hit_rate)} ({f.host_hit_tokens}/{f.prompt_tokens})"
    if what == "gpu":
        return pct(f.gpu_hit_rate)
    raise AssertionError(what)


ROWS = [
    ("starts", "starts"),
    ("chunk span T", "span"),
    ("units per group", "units"),
    ("host capacity", "capacity"),
    ("keys held [group:keys]", "keys"),
    ("row utilization", "util"),
    ("reusable prefix held", "held"),
    ("host hit rate", "hits"),
    ("GPU hit rate", "gpu"),
]


def print_result(r: Result, main_fraction: float) -> None:
    total_prefix = r.n * r.arch.prefix_tokens
    main = min(r.runs, key=lambda run: abs(run.fraction - main_fraction))
    up, sp = main.upstream, main.spillway
    print()
    print(f"== {r.arch.name} ({r.arch.what}) -- wall {r.seconds:.1f} s")
    print(f"   attention backend: {r.backend_note}")
    print(
        f"   workload: {r.n} prefixes x {r.arch.prefix_tokens} tok, {r.rounds} rounds "
        f"({r.n * r.rounds} requests), suffixes 1..{r.arch.chunk_tokens // 2} tok; "
        f"GPU KV {r.gpu_blocks} blocks; one prefix needs {fmt_bytes(r.need)} of host "
        f"({r.need_basis})"
    )
    print(f"   KV groups ({len(r.groups)}):")
    for g in r.groups:
        print(f"     {g}")
    print(f"   host budget B = {main.fraction:g} x {r.n} prefixes = {fmt_bytes(main.budget)}:")
    c1 = max(len(label) for label, _ in ROWS)
    c2 = max([len(column(up, w, total_prefix)) for _, w in ROWS] + [len("upstream")])
    print(f"     {'':<{c1}}  {'upstream':<{c2}}  Spillway")
    for label, what in ROWS:
        left, right = column(up, what, total_prefix), column(sp, what, total_prefix)
        print(f"     {label:<{c1}}  {left:<{c2}}  {right}")
    for f in (up, sp):
        if not f.starts:
            print(f"     {f.connector} does not start: {f.reason}")
    if len(r.runs) > 1:
        print("   budget sweep (upstream | Spillway: row utilization, prefix held, host hit rate):")
        for run in r.runs:
            cells = []
            for f in (run.upstream, run.spillway):
                if not f.starts:
                    cells.append("refuses")
                    continue
                cells.append(f"{pct(f.utilization):>6} {f.prefix_held:>6} tok {pct(f.hit_rate):>6}")
            mark = "" if run.ok else "  FAIL"
            print(
                f"     B = {run.fraction:g} x ({fmt_bytes(run.budget):>9}): "
                f"{cells[0]:<26} | {cells[1]}{mark}"
            )
    for run in r.runs:
        if run.ok and run is not main:
            continue
        details = "; ".join(f"{name}: {'ok' if ok else 'FAIL'}" for name, ok in run.checks)
        label = "" if len(r.runs) == 1 else f" (B = {run.fraction:g} x)"
        print(f"   checks{label}: {details}")
    others = "" if len(r.runs) == 1 else f" at all {len(r.runs)} budgets"
    print(f"   verdict: {'PASS' if r.ok else 'FAIL'}{others}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prefixes and rounds")
    parser.add_argument(
        "--arch",
        action="append",
        choices=[a.name for a in ARCHS],
        help="run only these architectures (repeatable)",
    )
    parser.add_argument("--prefixes", type=int, help="distinct prefixes N")
    parser.add_argument("--rounds", type=int, help="rounds R over the prefixes")
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        help="host budgets as shares of upstream's need for all prefixes "
        "(default 0.5 0.6 0.7; --quick: 0.6); the table shows the one nearest 0.6",
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    n = args.prefixes or (6 if args.quick else 24)
    rounds = args.rounds or (3 if args.quick else 4)
    fractions = args.fractions or ([MAIN_FRACTION] if args.quick else [0.5, MAIN_FRACTION, 0.7])
    archs = [a for a in ARCHS if not args.arch or a.name in args.arch]

    start = time.perf_counter()
    failed = []
    for arch in archs:
        t0 = time.perf_counter()
        result = run_arch(arch, n, rounds, fractions, args.seed)
        result.seconds = time.perf_counter() - t0
        print_result(result, MAIN_FRACTION)
        sys.stdout.flush()
        if not result.ok:
            failed.append(arch.name)
    print()
    print(
        f"total wall {time.perf_counter() - start:.1f} s; "
        f"{len(archs) - len(failed)}/{len(archs)} architectures pass"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
