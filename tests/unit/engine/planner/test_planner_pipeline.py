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
        assert (chunk.chunk_bytes == 0) == (held == 0)
    # the manager's unit ids mean the same on every stage: a chunk of a group takes the
    # units its widest stage needs, left unwritten on a stage holding none of its layers
    units = {tuple(g.units for g in s.spillway.groups) for s in p.stages if s.spillway}
    assert len(units) == 1 and all(units.pop())
    assert p.pool_bounding_stage is not None


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
    # Spillway's offloader refuses V4's packed groups; vLLM's runs it where no later
    # stage holds fewer rows than stage 0 (vLLM's own [22, 21] leaves stage 1 short)
    with pytest.raises(PlanRefused, match=r"\[22, 21\] \(vLLM's own split\) with offloader"):
        plan(config, tensor_parallel_size=4, pipeline_parallel_size=2, offloader="upstream")
    p = plan(config, tensor_parallel_size=4, pipeline_parallel_size=2, offloader="upstream",
             pipeline_layer_partition=[23, 20])
    assert [s.num_cache_layers for s in p.stages] == [
        len(s.cache_layer_indices) for s in p.stages
    ]


# ------------------------------------------------------------- uneven stages' pools


def test_spillway_hands_out_what_every_uneven_stage_holds():
    """vLLM's scheduler sizes the pool from stage 0 (30 of Llama-3.1-70B's 80 layers);
    stage 1's 50 layers hold fewer rows. Spillway's pool is what every stage holds."""
    config = load_model("llama-3.1-70b-instruct")
    p = plan(config, tensor_parallel_size=4, pipeline_parallel_size=2,
             pipeline_layer_partition=[30, 50], blocks_per_chunk=1)
    # vLLM's own figures per stage, unchanged (tests/contract: 17,476 and 10,485)
    assert [s.upstream.num_chunks for s in p.stages if s.upstream] == [17476, 10485]
    assert p.pool_bounding_stage == 1
    assert p.num_chunks == p.spillway.num_chunks == 10485
    for stage in p.stages:
        sw = stage.spillway
        assert sw is not None and sw.num_units == 10485
        assert stage.region_bytes == sw.region_bytes == 10485 * sw.unit_bytes * sw.copies
    assert p.spillway == p.stages[0].spillway  # the scheduler's view: stage 0's worker
    extra = p.kv_connector_extra_config
    assert (extra["spillway_num_units"], extra["spillway_group_units"]) == (10485, [1])
    assert p.kv_transfer_config["kv_connector_extra_config"] == extra
    assert any("hands out 10485 chunks" in n and "stage 1 bounds it" in n
               and "[17476, 10485]" in n for n in p.notes)
    assert read_plan(p.model_dump_json(), "test") == p


def test_a_chunk_takes_the_units_its_widest_stage_needs():
    """gpt-oss-120b at 17,19: stage 0's chunk of the full-attention group needs 8 units,
    stage 1's 10. The manager's unit ids mean the same on both stages."""
    p = plan(load_model("gpt-oss-120b"), tensor_parallel_size=4, pipeline_parallel_size=2,
             pipeline_layer_partition=[17, 19], blocks_per_chunk=1)
    assert [s.upstream.num_chunks for s in p.stages if s.upstream] == [116508, 104857]
    assert [[g.units for g in s.spillway.groups] for s in p.stages if s.spillway] == [
        [9, 10], [9, 10]
    ]
    assert p.pool_bounding_stage == 1
    assert p.num_chunks == 55188  # stage 1's own count: the smaller one
    assert any("each stage alone would hold [61680, 55188] chunks" in n for n in p.notes)


def test_even_stages_keep_their_plan():
    p = plan(load_model("llama-3.1-70b-instruct"), tensor_parallel_size=4,
             pipeline_parallel_size=2)
    assert p.pool_bounding_stage is None
    assert "spillway_num_units" not in p.kv_connector_extra_config
    assert p.stages[0].spillway == p.stages[1].spillway == p.spillway
    assert "pool_bounding_stage" not in p.model_dump(exclude_defaults=True)


def test_upstream_with_a_later_stage_holding_fewer_rows_is_refused():
    match = (r"\[30, 50\] with offloader upstream: vLLM's offloading manager hands out "
             r"stage 0's 1092 chunks, but stage\(s\) \[1\] hold only \[655\]")
    with pytest.raises(PlanRefused, match=match) as refused:
        plan(load_model("llama-3.1-70b-instruct"), tensor_parallel_size=4,
             pipeline_parallel_size=2, pipeline_layer_partition=[30, 50],
             offloader="upstream")
    assert refused.value.reason.startswith("pipeline_layer_partition (--pp-layer-partition")
    assert "offloader spillway" in refused.value.reason


def test_upstream_with_later_stages_holding_more_rows_runs():
    # stage 0 the widest: the manager's chunk count fits every later stage
    p = plan(load_model("llama-3.1-70b-instruct"), tensor_parallel_size=4,
             pipeline_parallel_size=2, pipeline_layer_partition=[50, 30],
             offloader="upstream")
    assert [s.upstream.num_chunks for s in p.stages if s.upstream] == [655, 1092]
    assert p.num_chunks == 655


def test_vllms_own_uneven_split_is_refused_for_upstream_naming_it():
    # 126 layers over 4 stages: [31, 32, 32, 31]; stages 1 and 2 hold fewer rows
    config = dict(load_model("llama-3.1-70b-instruct"), num_hidden_layers=126)
    with pytest.raises(PlanRefused, match=r"\[31, 32, 32, 31\] \(vLLM's own split\) with "
                                          r"offloader upstream.*stage\(s\) \[1, 2\]"):
        plan(config, tensor_parallel_size=8, pipeline_parallel_size=4, offloader="upstream")
    p = plan(config, tensor_parallel_size=8, pipeline_parallel_size=4)
    assert p.pool_bounding_stage == 1


def test_spillway_plan_says_which_stage_bounds_the_pool(capsys):
    code, out, _ = spillway_plan(capsys, "-tp", "4", "-pp", "2", "--pp-layer-partition",
                                 "30,50")
    assert code == 0
    assert "stage 1 bounds it" in out
    code, _, err = spillway_plan(capsys, "-tp", "4", "-pp", "2", "--pp-layer-partition",
                                 "30,50", "--offloader", "upstream")
    assert code == 2 and "pipeline_layer_partition" in err and err.count("\n") == 1
