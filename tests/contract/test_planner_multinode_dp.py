"""Data parallelism across nodes (DP attention, DP x EP MoE): the plan against vLLM 0.33.0.

DeepSeek-V3.2 and Kimi-K2 are served as DP engines across nodes with their experts spread
over every rank (``--enable-expert-parallel``): each DP rank is an engine of its own, with
its own KV cache and host pool, its TP ranks on one node. A replica of 16 GPUs on 2 nodes
of 8 runs ``vllm serve --data-parallel-size D --data-parallel-size-local D/2`` (the
multi-node form ``spillway_engine.launcher.multinode.parallel_launch`` builds), so vLLM's
``nnodes_within_dp`` is ``nnodes // (D // (D/2))`` = 1: each engine's ranks share one
node's /dev/shm, and ``build_offloading_config`` keeps the TP-replicated MLA layout (one
copy a row) for TP above 1, as on one node.

Each case builds one DP rank's vLLM config as vLLM does on its node, in two forms: the
flags Spillway's launcher passes (``parallel_launch``) and ``--nnodes 2 --node-rank r``
with ``data_parallel_size_local``; both with ``enable_expert_parallel`` and
``distributed_executor_backend="mp"`` (vLLM's pick on CUDA). The DP rank is set on the
config as vLLM's engine core process sets it (an EngineArgs ``data_parallel_rank`` would
mean external load balancing, which refuses a local size above 1). The model is built
on the meta device by ``test_planner_pipeline``'s harness with one stage, for the first
and last rank of each node; then vLLM's ``build_offloading_config`` +
``CPUOffloadingSpec`` and Spillway's connector geometry (``build_geometry``) for a 64 GiB
pool. The plan (``make_plan`` with ``data_parallel_size`` D and ``nodes`` 2) must say the
same for every engine: KV-cache groups, bytes per block, replicated or not, rows/chunks
and units; and its figures per engine are those of one engine at its TP on one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from vllm.config import get_current_vllm_config
from vllm.distributed import parallel_state
from vllm.engine.arg_utils import EngineArgs

from spillway_engine.launcher.multinode import Node as LaunchNode
from spillway_engine.launcher.multinode import parallel_launch
from spillway_engine.offloader import geometry as geometry_module
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan

from . import test_planner_pipeline as pipeline
from . import vllm_harness as harness
from .test_planner_frontier import STAND_IN
from .test_planner_multinode import assert_connector_geometry, vllm_copies
from .test_planner_pipeline import MODELS, POOL, PPCase, VllmPipeline, as_vllm, stage_offload

NODES = 2
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class DPCase:
    model: str
    tp: int

    @property
    def dp(self) -> int:
        """Engines of the 16-GPU replica: DP 16 at TP 1, DP 8 at TP 2."""
        return NODES * GPUS_PER_NODE // self.tp

    @property
    def local(self) -> int:
        return self.dp // NODES

    def ranks(self) -> list[tuple[int, int]]:
        """(node rank, DP rank): the first and the last engine of each node."""
        return [(n, n * self.local + i) for n in range(NODES) for i in (0, self.local - 1)]

    def __str__(self) -> str:
        return f"{self.model}-dp{self.dp}-tp{self.tp}"


CASES = [DPCase(model, tp) for model in ("deepseek-v3.2", "kimi-k2") for tp in (1, 2)]
FORMS = ["launcher", "nnodes"]


def plan_for(case: DPCase, offloader: str, dp: int | None = None, nodes: int = NODES) -> Plan:
    return make_plan(
        MODELS[case.model](),
        PlanRequest(
            tensor_parallel_size=case.tp,
            data_parallel_size=case.dp if dp is None else dp,
            nodes=nodes,
            gpu="h200",
            max_model_len=8192,
            cpu_memory_bytes=POOL,
            offloader=offloader,  # type: ignore[arg-type]
        ),
    )


def launch_flags(plan: Plan, form: str, node: int) -> dict[str, Any]:
    """EngineArgs for node ``node``'s vLLM. ``launcher``: the flags Spillway's engine
    passes (``parallel_launch``: ``--data-parallel-size-local``, ``--data-parallel-address``,
    ``--data-parallel-rpc-port``, ``--data-parallel-start-rank`` on node 1; its
    ``--headless`` is create_engine_config's, not an EngineArgs field, and only stops
    vLLM inferring hybrid load balancing). ``nnodes``: the same engines described with
    ``--nnodes 2 --node-rank r``."""
    flags: dict[str, Any] = dict(
        tensor_parallel_size=plan.parallelism.tensor_parallel_size,
        data_parallel_size=plan.parallelism.data_parallel_size,
        enable_expert_parallel=True,
        distributed_executor_backend="mp",
    )
    if form == "nnodes":
        local = plan.parallelism.data_parallel_size // NODES
        return {**flags, "data_parallel_size_local": local, "nnodes": NODES, "node_rank": node}
    args, env = parallel_launch(plan, LaunchNode(NODES, node, "10.0.0.1"))
    assert env == {}
    names = dict(zip(args[::2], args[1::2], strict=False))
    flags.update(
        data_parallel_size_local=int(names["--data-parallel-size-local"]),
        data_parallel_address=names["--data-parallel-address"],
        data_parallel_rpc_port=int(names["--data-parallel-rpc-port"]),
    )
    if node > 0:
        assert "--headless" in args
        flags["data_parallel_start_rank"] = int(args[args.index("--data-parallel-start-rank") + 1])
    return flags


def rank_engine_args(flags: dict[str, Any], rank: int, local_rank: int) -> Any:
    """EngineArgs whose config is DP rank ``rank``'s, as vLLM's engine core process sets
    it (``EngineCoreProc.run_engine_core``: data_parallel_rank, _rank_local, _index)."""

    class RankEngineArgs(EngineArgs):
        def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
            vc = super().create_engine_config(*args, **kwargs)
            parallel = vc.parallel_config
            parallel.data_parallel_rank = parallel.data_parallel_index = rank
            parallel.data_parallel_rank_local = local_rank
            return vc

    def make(**kwargs: Any) -> Any:
        kwargs.pop("tensor_parallel_size", None)  # the harness passes the case's
        return RankEngineArgs(**{**flags, **kwargs})

    return make


_initialize_model_parallel = pipeline.initialize_model_parallel


def _one_rank_groups(*args: Any, **kwargs: Any) -> None:
    """The harness's one-rank groups under a DP config: made as for DP 1 (the process's
    world is one rank), then the DP and EP groups report the engine's DP rank among all
    DP ranks, as the harness's TP group reports its TP size."""
    parallel = get_current_vllm_config().parallel_config
    dp = parallel.data_parallel_size
    parallel.data_parallel_size = 1
    try:
        _initialize_model_parallel(*args, **kwargs)
    finally:
        parallel.data_parallel_size = dp
    group = parallel_state.get_dp_group()
    group.world_size, group.rank_in_group = dp, parallel.data_parallel_rank


class DPRanks:
    """Each (case, form, DP rank)'s vLLM config, built once for the module."""

    def __init__(self) -> None:
        self._built: dict[tuple[DPCase, str, int], VllmPipeline] = {}

    def get(self, case: DPCase, plan: Plan, form: str, node: int, rank: int) -> VllmPipeline:
        key = (case, form, rank)
        if key not in self._built:
            pipeline._cpu_workspace()
            # this process's one-rank world, made before a DP config is current: under
            # one, init_distributed_environment widens it to every DP rank and waits
            harness._init_distributed()
            flags = launch_flags(plan, form, node)
            backend = plan.gpu.attention_backend
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(pipeline, "EngineArgs", rank_engine_args(flags, rank, rank % case.local))
                mp.setattr(pipeline, "initialize_model_parallel", _one_rank_groups)
                built = pipeline.build_pipeline(
                    MODELS[case.model](),
                    PPCase(case.model, case.tp, 1, gpu="h200"),
                    STAND_IN.get(backend or "", backend),
                )
            parallel = built.stages[0].vllm_config.parallel_config
            assert (parallel.data_parallel_size, parallel.data_parallel_size_local) == (
                case.dp, case.local
            )
            assert (parallel.data_parallel_rank, parallel.data_parallel_index) == (rank, rank)
            assert parallel.data_parallel_rank_local == rank % case.local
            assert parallel.enable_expert_parallel
            assert parallel.distributed_executor_backend == "mp"
            if form == "nnodes":
                assert (parallel.nnodes, parallel.node_rank) == (NODES, node)
            # one engine's ranks on one node: what the plan's single_node follows
            assert parallel.nnodes_within_dp == 1
            assert parallel.world_size == parallel.local_world_size == case.tp
            self._built[key] = built
        return self._built[key]


@pytest.fixture(scope="module")
def dp_ranks() -> DPRanks:
    return DPRanks()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_dp_rank_plans_as_the_plan_says(case: DPCase, form: str, dp_ranks: DPRanks,
                                              monkeypatch: pytest.MonkeyPatch):
    # replicated MLA ranks share one /dev/shm region on CUDA (the check is CUDA-only)
    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    up_plan, sw_plan = plan_for(case, "upstream"), plan_for(case, "spillway")
    for plan in (up_plan, sw_plan):
        par = plan.parallelism
        assert (par.nodes, par.data_parallel_size, par.world_size) == (NODES, case.dp, case.tp)
        assert plan.pod.engines == case.local  # whole engines a node
        assert plan.cpu_memory_bytes == POOL
    up, sw = up_plan.upstream, sw_plan.spillway
    assert up is not None
    replicated = case.tp > 1  # MLA, TP only, one node an engine
    for node, rank in case.ranks():
        built = dp_ranks.get(case, up_plan, form, node, rank)
        where = f"DP rank {rank} on node {node}"
        assert built.stage_block_sizes == [up_plan.block_size], where
        assert as_vllm(up_plan.kv_groups) == built.global_groups, where
        stage = built.stages[0]
        off = stage_offload(
            stage, {"cpu_bytes_to_use": POOL, "blocks_per_chunk": up_plan.blocks_per_chunk}
        )
        assert up_plan.worker_bytes_per_block == off["worker_bytes_per_block"], where
        assert up_plan.tokens_per_hash == off["tokens_per_hash"], where
        assert off["world_size"] == case.tp, where
        assert off["replicated_layout"] is replicated, where
        assert up.replicated_layout is replicated and up.copies == vllm_copies(off), where
        assert up.blocks_per_chunk == off["blocks_per_chunk"], where
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"]), where
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"], where
        # Spillway's connector on the same rank
        assert_connector_geometry(sw, stage, 1 if replicated else case.tp, where)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_per_engine_figures_are_one_engine_on_one_node(case: DPCase):
    """Each engine is planned as one engine of its TP on one node; each node's pod as
    the one-node pod of DP / nodes such engines."""
    for offloader in ("upstream", "spillway"):
        across = plan_for(case, offloader)
        alone = plan_for(case, offloader, dp=1, nodes=1)
        one_node = plan_for(case, offloader, dp=case.local, nodes=1)
        assert (across.kv_groups, across.upstream, across.spillway) == (
            alone.kv_groups, alone.upstream, alone.spillway
        )
        assert (across.num_chunks, across.capacity_tokens) == (
            alone.num_chunks, alone.capacity_tokens
        )
        assert across.pod == one_node.pod
        assert across.pod.pool_bytes_per_pod == case.local * across.pod.pool_bytes_per_engine
