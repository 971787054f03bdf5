"""Multi-node engines (vLLM ``--nnodes``): the planner's host rows against vLLM 0.33.0's.

One engine's TP x PP ranks spread evenly over N nodes changes one thing in vLLM's
offloading: ``build_offloading_config`` keeps the TP-replicated MLA layout (one copy per
host row, the ranks sharing one /dev/shm region) only while
``parallel_config.nnodes_within_dp == 1`` (and, as on one node, only without pipeline
stages); across nodes every row holds every rank's copy. The planner says so with
``PlanRequest.nodes`` (``single_node`` in its offload geometry).

Each case builds vLLM's config as ``vllm serve --nnodes N --node-rank R`` does
(``EngineArgs`` with ``nnodes``/``node_rank``, ``distributed_executor_backend="mp"``: the
backend vLLM picks on CUDA when ``nnodes > 1``, set by hand as the CPU would not), each
pipeline stage's model on the meta device (``test_planner_pipeline.build_pipeline``),
then each stage's ``build_offloading_config`` + ``CPUOffloadingSpec`` on every node that
hosts a rank of the stage, and Spillway's connector geometry (the engine's own
``build_geometry``) on the same configs. The plan (``make_plan`` with ``nodes``) must
say the same: replicated or not, copies per row, row bytes and rows (or units) for a
64 GiB pool, per stage. The same topology on one node is planned too: for the MLA
models the replicated layout (copies 1) there is vLLM's, in both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.math_utils import round_up

from spillway_engine.offloader import geometry as geometry_module
from spillway_engine.offloader.geometry import build_geometry, with_extra_config
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan

from . import test_planner_pipeline as pipeline
from .test_planner_frontier import STAND_IN
from .test_planner_pipeline import MODELS, POOL, PPCase, VllmPipeline, stage_offload

MLA_MODELS = ("deepseek-v3.2", "kimi-k2")
#: (TP, PP): 16 ranks over 2 nodes of 8, 2 stages of 8 (one a node), 8 ranks over 2 of 4
TOPOLOGIES = [(16, 1), (8, 2), (8, 1)]
CASES = [
    PPCase(model, tp, pp)
    for model in ("deepseek-v3.2", "kimi-k2", "llama-405b", "qwen3.5-397b")
    for tp, pp in TOPOLOGIES
]


def plan_for(case: PPCase, nodes: int, offloader: str) -> Plan:
    return make_plan(
        MODELS[case.model](),
        PlanRequest(
            tensor_parallel_size=case.tp,
            pipeline_parallel_size=case.pp,
            nodes=nodes,
            gpu=case.gpu,
            max_model_len=case.max_model_len,
            cpu_memory_bytes=POOL,
            offloader=offloader,  # type: ignore[arg-type]
        ),
    )


@dataclass(frozen=True)
class Node:
    nodes: int
    rank: int

    def hosts(self, case: PPCase, stage: int) -> bool:
        """Whether a rank of pipeline stage ``stage`` runs on this node (vLLM places
        ranks in order, ``world_size // nnodes`` a node)."""
        local = case.tp * case.pp // self.nodes
        first, end = self.rank * local, (self.rank + 1) * local
        return first < (stage + 1) * case.tp and stage * case.tp < end


def nodes_of(n: int) -> list[Node]:
    return [Node(n, r) for r in range(n)]


class MultiNodePipelines:
    """vLLM's per-stage configs built once per (case, node) for the module."""

    def __init__(self) -> None:
        self._built: dict[tuple[PPCase, Node], VllmPipeline] = {}

    def get(self, case: PPCase, node: Node, backend: str | None) -> VllmPipeline:
        key = (case, node)
        if key not in self._built:
            pipeline._cpu_workspace()
            engine_args = functools.partial(
                EngineArgs,
                nnodes=node.nodes,
                node_rank=node.rank,
                distributed_executor_backend="mp",
            )
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(pipeline, "EngineArgs", engine_args)
                built = pipeline.build_pipeline(
                    MODELS[case.model](), case, STAND_IN.get(backend or "", backend)
                )
            for stage in built.stages:
                parallel = stage.vllm_config.parallel_config
                assert (parallel.nnodes, parallel.node_rank) == (node.nodes, node.rank)
                assert parallel.nnodes_within_dp == node.nodes
                assert parallel.distributed_executor_backend == "mp"
                assert parallel.world_size == case.tp * case.pp
                assert parallel.local_world_size == case.tp * case.pp // node.nodes
            self._built[key] = built
        return self._built[key]


@pytest.fixture(scope="module")
def multinode() -> MultiNodePipelines:
    return MultiNodePipelines()


def vllm_copies(off: dict[str, Any]) -> int:
    """CPUOffloadingSpec's copies per row (its shared region stands in as on CUDA)."""
    return 1 if off["replicated_layout"] else off["world_size"]


def planned_stages(plan: Plan) -> list[tuple[int, Any, Any, int]]:
    """(stage, upstream, spillway, worker bytes per block) of each stage; a plan without
    pipeline stages lists none, its top level is stage 0's."""
    if plan.stages:
        return [(s.stage, s.upstream, s.spillway, s.worker_bytes_per_block)
                for s in plan.stages]
    return [(0, plan.upstream, plan.spillway, plan.worker_bytes_per_block)]


def assert_connector_geometry(sw: Any, stage: Any, copies: int, where: str) -> None:
    """Spillway's connector (``build_geometry``) on vLLM's config of one rank lays out
    the host pool as the plan's ``sw`` (its Spillway geometry) says, with ``copies``."""
    vc = with_extra_config(stage.vllm_config, dict(sw.kv_connector_extra_config))
    layout = build_geometry(vc, stage.kv_cache_config).layout
    assert layout.copies == copies, where
    assert (sw.copies, sw.unit_bytes, sw.num_units) == (
        layout.copies, layout.unit_bytes, layout.num_units
    ), where
    assert [g.chunk_bytes for g in sw.groups] == [
        g.chunk_bytes * layout.copies for g in layout.groups
    ], where


def expect_replicated(case: PPCase, nodes: int) -> bool:
    return case.model in MLA_MODELS and case.pp == 1 and nodes == 1


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_upstream_rows_match_vllm(case: PPCase, nodes: int, multinode: MultiNodePipelines):
    """vLLM's OffloadingConnector on every node hosting a stage: replicated or not,
    copies, chunk, row bytes and rows of the 64 GiB pool, as the plan says."""
    plan = plan_for(case, nodes, "upstream")
    assert plan.parallelism.nodes == nodes
    checked = set()
    for node in nodes_of(nodes):
        built = multinode.get(case, node, plan.gpu.attention_backend)
        for stage, up, _, worker_bytes in planned_stages(plan):
            if not node.hosts(case, stage):
                continue
            checked.add(stage)
            assert up is not None
            off = stage_offload(
                built.stages[stage],
                {"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk},
            )
            where = f"stage {stage} on node {node.rank} of {nodes}"
            assert off["replicated_layout"] is expect_replicated(case, nodes), where
            assert up.replicated_layout is off["replicated_layout"], where
            assert up.copies == vllm_copies(off), where
            assert worker_bytes == off["worker_bytes_per_block"], where
            assert up.blocks_per_chunk == off["blocks_per_chunk"], where
            assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"]), where
    assert checked == set(range(case.pp))
    assert plan.upstream is not None
    assert (plan.row_bytes, plan.num_chunks) == (
        plan.upstream.row_bytes, plan.upstream.num_chunks
    )


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_spillway_pool_matches_the_connector(
    case: PPCase, nodes: int, multinode: MultiNodePipelines, monkeypatch: pytest.MonkeyPatch
):
    """Spillway's connector geometry (what the engine builds from vLLM's config, its
    copies from build_offloading_config's replicated_layout) on every node hosting a
    stage: copies, unit bytes and units as the plan sized them."""
    # replicated MLA ranks share one /dev/shm region on CUDA (the check is CUDA-only)
    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    plan = plan_for(case, nodes, "spillway")
    checked = set()
    for node in nodes_of(nodes):
        built = multinode.get(case, node, plan.gpu.attention_backend)
        for stage, _, sw, _ in planned_stages(plan):
            if not node.hosts(case, stage):
                continue
            checked.add(stage)
            assert sw is not None
            vllm_stage = built.stages[stage]
            where = f"stage {stage} on node {node.rank} of {nodes}"
            expected_copies = 1 if expect_replicated(case, nodes) else case.tp * case.pp
            assert_connector_geometry(sw, vllm_stage, expected_copies, where)
    assert checked == set(range(case.pp))


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("model", MLA_MODELS)
def test_mla_rows_replicate_on_one_node_only(
    model: str, tp: int, multinode: MultiNodePipelines
):
    """The same engine on one node and on two: vLLM's replicated layout (one copy a
    row) holds on one node only; across nodes a row holds all TP copies (rows rounded
    up to 4 KiB), so a 64 GiB pool keeps about TP times fewer. The plans say the same."""
    case = PPCase(model, tp, 1)
    one, two = (plan_for(case, n, "upstream") for n in (1, 2))
    offs = []
    for plan, node in ((one, Node(1, 0)), (two, Node(2, 0))):
        built = multinode.get(case, node, plan.gpu.attention_backend)
        offs.append(stage_offload(
            built.stages[0], {"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk}
        ))
    assert one.blocks_per_chunk == two.blocks_per_chunk
    assert [o["replicated_layout"] for o in offs] == [True, False]
    assert [vllm_copies(o) for o in offs] == [1, tp]
    assert [p.upstream.copies for p in (one, two)] == [1, tp]  # type: ignore[union-attr]
    assert [p.spillway.copies for p in (one, two)] == [1, tp]
    assert [(p.row_bytes, p.num_chunks) for p in (one, two)] == [
        (o["row_bytes"], o["num_chunks"]) for o in offs
    ]
    # same GPU blocks either way: only the copies per row differ
    worker = offs[0]["worker_bytes_per_block"] * one.blocks_per_chunk
    assert offs[1]["worker_bytes_per_block"] * two.blocks_per_chunk == worker
    assert [o["row_bytes"] for o in offs] == [round_up(worker, 4096), round_up(tp * worker, 4096)]
    assert [o["num_chunks"] for o in offs] == [POOL // o["row_bytes"] for o in offs]
