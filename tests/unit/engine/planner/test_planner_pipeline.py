"""Pipeline parallelism in the planner: the layer split (against vLLM's own
``get_pp_indices``), the stages' layers and groups, and the refusals.

The stages' KV-cache groups and host pools are checked against vLLM's per-worker
planning in ``tests/contract/test_planner_pipeline.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_cli import main as cli
from spillway_engine.planner.families import model_shape
from spillway_engine.planner.gpus import get_gpu
from spillway_engine.planner.kv_layout import (
    LayoutRequest,
    compute_layout,
    parse_pp_layer_partition,
    pp_indices,
    pp_partition,
)
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan, read_plan
from spillway_engine.planner.shape import UnsupportedModel
from tests.unit.planner_fixtures import MODELS, load_frontier, load_model

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.distributed.utils import get_pp_indices

GIB = 2**30


@contextmanager
def partition_env(text: str | None) -> Iterator[None]:
    saved = os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    if text is not None:
        os.environ["VLLM_PP_LAYER_PARTITION"] = text
    try:
        yield
    finally:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        if saved is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = saved


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 400), pp=st.integers(1, 64))
def test_default_split_is_vllms(layers: int, pp: int):
    with partition_env(None):
        expected = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    assert [pp_indices(layers, rank, pp) for rank in range(pp)] == expected
    assert sum(pp_partition(layers, pp)) == layers


@settings(max_examples=300, deadline=None)
@given(partition=st.lists(st.integers(0, 80), min_size=1, max_size=16))
def test_a_given_partition_is_vllms(partition: list[int]):
    layers, pp = sum(partition), len(partition)
    with partition_env(",".join(map(str, partition))):
        expected = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    assert [pp_indices(layers, rank, pp, tuple(partition)) for rank in range(pp)] == expected


@settings(max_examples=200, deadline=None)
@given(
    partition=st.lists(st.integers(0, 80), min_size=1, max_size=16),
    layers=st.integers(1, 600),
    pp=st.integers(1, 16),
)
def test_partitions_vllm_refuses_are_refused(partition: list[int], layers: int, pp: int):
    text = ",".join(map(str, partition))
    with partition_env(text):
        try:
            get_pp_indices(layers, 0, pp)
            vllm_refuses = False
        except ValueError:
            vllm_refuses = True
    if vllm_refuses:
        with pytest.raises(UnsupportedModel, match="pipeline_layer_partition"):
            pp_partition(layers, pp, parse_pp_layer_partition(text))
    else:
        assert pp_partition(layers, pp, parse_pp_layer_partition(text)) == tuple(partition)


@pytest.mark.parametrize("text", ["", "3,,4", "a,b", "1.5,2"])
def test_a_partition_that_is_no_list_of_integers_is_refused_as_vllm_refuses(text: str):
    with partition_env(text), pytest.raises(ValueError, match="Invalid partition string"):
        get_pp_indices(7, 0, 2)
    with pytest.raises(UnsupportedModel, match="comma-separated list of integers"):
        parse_pp_layer_partition(text)


def layout(config, gpu="h100", **kw):
    kw.setdefault("max_model_len", 4096)
    return compute_layout(model_shape(config), get_gpu(gpu), LayoutRequest(**kw))


def plan(config, **kw):
    kw.setdefault("cpu_memory_bytes", 64 * GIB)
    return make_plan(config, PlanRequest(**kw))


def test_without_pipeline_parallelism_there_are_no_stages():
    config = load_model("llama-3.1-70b-instruct")
    one = plan(config, tensor_parallel_size=8)
    assert one.stages == []
    assert "stages" not in one.model_dump(exclude_defaults=True)


def test_dense_stages_split_the_layers_and_the_bytes_per_block():
    config = load_model("llama-3.1-70b-instruct")
    whole = layout(config, tensor_parallel_size=8)
    lay = layout(config, tensor_parallel_size=8, pipeline_parallel_size=3)
    # 80 = 27 + 27 + 26 (the remainder goes to the stages before the last)
    assert [(s.first_layer, s.end_layer) for s in lay.stages] == [(0, 27), (27, 54), (54, 80)]
    assert lay.groups == whole.groups  # grouping is the whole model's
    page = whole.groups[0].page_bytes
    assert [s.layout.worker_bytes_per_block for s in lay.stages] == [27 * page, 27 * page,
                                                                       26 * page]
    assert [s.layout.groups[0].layer_indices for s in lay.stages] == [
        tuple(range(0, 27)), tuple(range(27, 54)), tuple(range(54, 80))
    ]


def test_the_plan_reports_each_stage_and_takes_stage_0_for_the_scheduler():
    config = load_model("llama-3.1-70b-instruct")
    p = plan(config, tensor_parallel_size=4, pipeline_parallel_size=2, offloader="upstream")
    assert p.parallelism.world_size == 8
    assert [(s.first_layer, s.end_layer, s.num_cache_layers) for s in p.stages] == [
        (0, 40, 40), (40, 80, 40)
    ]
    assert p.worker_bytes_per_block == p.stages[0].worker_bytes_per_block
    assert p.kv_groups[0].num_layers == 80  # the model's groups, every layer
    assert [g.num_layers for s in p.stages for g in s.kv_groups] == [40, 40]
    for stage in p.stages:
        assert stage.upstream is not None and stage.spillway is not None
        assert stage.upstream.copies == 8  # vLLM: one slot per worker of the world
        assert stage.region_bytes == stage.upstream.region_bytes
    assert read_plan(p.model_dump_json(), "test") == p


def test_uneven_stages_are_noted():
    config = load_model("llama-3.1-70b-instruct")
    p = plan(config, tensor_parallel_size=8, pipeline_parallel_size=3, offloader="upstream")
    assert any("split unevenly over 3 stages: [27, 27, 26]" in n for n in p.notes)
    assert any("bytes per block" in n and "stage 0's" in n for n in p.notes)


def test_a_given_partition_is_recorded_for_the_engine():
    config = load_model("llama-3.1-70b-instruct")
    p = plan(config, pipeline_parallel_size=2, pipeline_layer_partition=[50, 30],
             tensor_parallel_size=8)
    assert p.parallelism.pipeline_layer_partition == [50, 30]
    assert [(s.first_layer, s.end_layer) for s in p.stages] == [(0, 50), (50, 80)]


def test_sparse_mla_keeps_a_layers_indexer_and_latent_on_one_stage():
    """DeepSeek-V3.2: two caches per decoder layer (indexer keys, latent); the split is
    by decoder layer, and the mixed-page group keeps each stage's own pages."""
    config = load_frontier("deepseek-v3.2-exp")
    lay = layout(config, tensor_parallel_size=8, pipeline_parallel_size=4)
    # 61 = 15 + 15 + 16 + 15
    assert [(s.first_layer, s.end_layer) for s in lay.stages] == [
        (0, 15), (15, 30), (30, 46), (46, 61)
    ]
    assert [len(s.cache_layers) for s in lay.stages] == [30, 30, 32, 30]
    (whole,) = lay.groups
    for stage in lay.stages:
        (group,) = stage.layout.groups
        assert group.layer_indices == stage.cache_layers
        assert group.page_bytes == sum(group.layer_page_bytes)
        assert stage.layout.worker_bytes_per_block == group.page_bytes
    assert sum(s.layout.groups[0].page_bytes for s in lay.stages) == whole.page_bytes


def test_mtp_layers_sit_on_the_last_stage():
    config = load_frontier("deepseek-v3.2-exp")
    p = plan(config, tensor_parallel_size=8, pipeline_parallel_size=2,
             speculative_method="mtp", num_speculative_tokens=1)
    assert p.draft_layer_indices == [122, 123]  # 61 layers x 2 caches, then the MTP pair
    assert p.stages[0].draft_layer_indices == []
    assert p.stages[1].draft_layer_indices == [122, 123]
    assert p.stages[1].num_cache_layers == 2 * 30 + 2  # 61 = 31 + 30


def test_nemotron_h_splits_by_decoder_layer_with_the_mlp_layers_counted():
    config = load_model("nemotron-h-8b-base-8k")
    pattern = config["hybrid_override_pattern"]
    lay = layout(config, pipeline_parallel_size=2)
    assert [(s.first_layer, s.end_layer) for s in lay.stages] == [(0, 26), (26, 52)]
    cached = [i for i, c in enumerate(pattern) if c in "M*"]
    first_stage = sum(1 for i in cached if i < 26)
    assert len(lay.stages[0].cache_layers) == first_stage
    assert len(lay.stages[1].cache_layers) == len(cached) - first_stage


def test_hybrid_stages_keep_every_group_even_where_a_stage_holds_few_layers():
    config = load_frontier("qwen3.5-35b-a3b")
    lay = layout(config, tensor_parallel_size=2, pipeline_parallel_size=4,
                 pp_layer_partition=(18, 6, 8, 8))
    for stage in lay.stages:
        assert len(stage.layout.groups) == len(lay.groups)
        held = sorted(i for g in stage.layout.groups for i in g.layer_indices)
        assert held == list(stage.cache_layers)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(pipeline_parallel_size=200), "pipeline_parallel_size 200 exceeds the model's 80"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=[0, 80]),
         r"stage\(s\) \[0\] would hold no KV-cache layer"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=[40, 41]),
         "sums to 81, not the model's 80 decoder layers"),
        (dict(pipeline_parallel_size=3, pipeline_layer_partition=[40, 40]),
         "2 entries for pipeline_parallel_size 3"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=[-1, 81]), "negative entry"),
        (dict(pipeline_layer_partition=[80]), "without pipeline parallelism"),
        (dict(pipeline_parallel_size=2, disk_bytes=100 * GIB), "disk tier"),
    ],
)
def test_refusals_name_the_field(kw, match):
    with pytest.raises(PlanRefused, match=match):
        plan(load_model("llama-3.1-70b-instruct"), tensor_parallel_size=8, **kw)


def test_a_separate_drafter_with_pipeline_parallelism_is_refused():
    with pytest.raises(PlanRefused, match="draft_model drafter with pipeline parallelism"):
        plan(load_model("llama-3.1-70b-instruct"), tensor_parallel_size=8,
             pipeline_parallel_size=2, speculative_method="draft_model",
             num_speculative_tokens=2)


def test_gemma4_kv_sharing_with_pipeline_parallelism_is_refused():
    config = load_frontier("gemma-4-e2b")
    with pytest.raises(PlanRefused, match="KV-shared layers: pipeline parallelism"):
        plan(config, gpu="a100", pipeline_parallel_size=2)


def test_a_group_a_stage_holds_no_layer_of_takes_no_host_bytes_there():
    config = load_model("nemotron-h-8b-base-8k")
    p = plan(config, pipeline_parallel_size=3, pipeline_layer_partition=[10, 20, 22])
    first = p.stages[0]
    empty = [i for i, g in enumerate(first.kv_groups) if g.num_layers == 0]
    assert empty  # the first 10 decoder layers hold 5 cache layers for 7 groups
    assert first.worker_bytes_per_block == max(g.bytes_per_block for g in first.kv_groups)
    spill = first.spillway
    assert spill is not None
    for chunk in spill.groups:
        held = first.kv_groups[chunk.group_index].num_layers
        assert (chunk.units == 0) == (held == 0)
        assert (chunk.row_bytes == 0) == (held == 0)


LLAMA_70B = str(MODELS / "llama-3.1-70b-instruct.json")


def spillway_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", "--model-config", LLAMA_70B, "--cpu-memory", "64Gi", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_spillway_plan_prints_each_stage(capsys):
    code, out, _ = spillway_plan(capsys, "-tp", "8", "-pp", "3", "--offloader", "upstream")
    assert code == 0
    assert "Pipeline stages (vLLM's split" in out
    rows = out.split("Pipeline stages", 1)[1].splitlines()[3:6]
    assert [row.split()[:4] for row in rows] == [
        ["0", "0-26", "27", "27"], ["1", "27-53", "27", "27"], ["2", "54-79", "26", "26"]
    ]
    code, out, _ = spillway_plan(capsys, "-tp", "8", "-pp", "2", "--pp-layer-partition",
                                 "50,30", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    assert plan["parallelism"]["pipeline_layer_partition"] == [50, 30]
    assert [(s["first_layer"], s["end_layer"]) for s in plan["stages"]] == [(0, 50), (50, 80)]


@pytest.mark.parametrize(
    ("partition", "match"),
    [("50;30", "comma-separated list of integers"), ("50,20", "sums to 70")],
)
def test_spillway_plan_refuses_a_bad_partition_in_one_line(capsys, partition, match):
    code, _, err = spillway_plan(capsys, "-tp", "8", "-pp", "2", "--pp-layer-partition",
                                 partition)
    assert code == 2
    assert match in err and err.count("\n") == 1


def test_a_hybrid_stage_without_an_attention_layer_is_refused():
    """vLLM's worker aligns its block to the Mamba state only when it finds an attention
    backend among its own layers; a stage of GDN layers only keeps 16-token blocks."""
    config = load_frontier("qwen3.5-35b-a3b")
    with pytest.raises(PlanRefused, match=r"pipeline stage 0 \(decoder layers 0-2\) holds only"):
        plan(config, tensor_parallel_size=2, pipeline_parallel_size=2,
             pipeline_layer_partition=[3, 37])
    plan(config, tensor_parallel_size=2, pipeline_parallel_size=2,
         pipeline_layer_partition=[4, 36])


def test_a_deepseek_v4_stage_lacking_a_kind_of_cache_is_refused():
    config = load_frontier("deepseek-v4-flash")
    with pytest.raises(PlanRefused, match=r"stage 0 .* holds only some of"):
        plan(config, tensor_parallel_size=4, pipeline_parallel_size=2,
             pipeline_layer_partition=[2, 41])
    # [22, 21]; Spillway's offloader refuses V4's packed groups, vLLM's runs it
    p = plan(config, tensor_parallel_size=4, pipeline_parallel_size=2, offloader="upstream")
    assert [s.num_cache_layers for s in p.stages] == [
        len(s.cache_layer_indices) for s in p.stages
    ]
