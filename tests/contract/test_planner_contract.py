"""The planner's KV groups and offload geometry equal vLLM 0.33.0's, case by case."""

from __future__ import annotations

import pytest

from spillway_engine.planner.plan import Plan, PlanRefused, PlanRequest, make_plan

from .conftest import LayoutCache, load_model
from .vllm_harness import VLLM_VERSION, Case, vllm_default_max_model_len

GIB = 2**30
POOL = 64 * GIB

LAYOUT_CASES = [
    # dense full attention
    Case("llama-3.2-1b"),
    Case("llama-3.2-1b", 2),
    Case("llama-3.2-1b", 4, gpu="a100"),
    Case("llama-3.2-1b", kv_cache_dtype="fp8"),
    Case("llama-3.2-1b", block_size=32),
    Case("llama-3.1-70b-instruct", 8),
    Case("llama-3.1-70b-instruct", 16),  # 8 KV heads over 16 ranks: replicated heads
    Case("qwen2.5-7b-instruct", 2),
    Case("qwen3-30b-a3b", 8),  # 4 KV heads over 8 ranks
    # sliding window on every layer
    Case("mistral-7b-v0.1", 2),
    Case("phi-3-mini-4k-instruct", max_model_len=4096),
    Case("phi-3-mini-4k-instruct", 4, max_model_len=4096),
    # sliding window + full, equal heads
    Case("gemma-2-9b", 2),
    Case("gemma-3-1b-it"),
    Case("gemma-3-12b-it", 2),
    Case("gemma-3-27b-it"),
    Case("gemma-3-27b-it", 4),
    Case("gpt-oss-120b"),
    Case("gpt-oss-120b", 4),
    # chunked local attention + global NoPE layers
    Case("llama-4-scout-17b-16e"),
    Case("llama-4-scout-17b-16e", 4),
    # MLA
    Case("deepseek-v2-lite"),
    Case("deepseek-v2-lite", 2),
    Case("deepseek-v2-lite", kv_cache_dtype="fp8"),  # FlashMLA on Hopper: 64-token blocks
    Case("deepseek-v2-lite", 2, kv_cache_dtype="fp8", block_size=128),
    Case("deepseek-v3", 8),
    # Mamba / GDN hybrids
    Case("qwen3-next-80b-a3b-instruct"),
    Case("qwen3-next-80b-a3b-instruct", 4),
    Case("qwen3-next-80b-a3b-instruct", gpu="a100"),
    Case("qwen3-next-80b-a3b-instruct", 4, gpu="a100"),
    Case("jamba-mini-1.5"),
    Case("jamba-mini-1.5", 2),
    Case("jamba-mini-1.5", dtype="float16", kv_cache_dtype="fp8"),
    Case("nemotron-h-8b-base-8k"),
    Case("nemotron-h-8b-base-8k", 2),
]
BLOCKS_PER_CHUNK = [None, 1, 4, 16]


def plan_for(case: Case, **kw) -> Plan:
    kw.setdefault("cpu_memory_bytes", POOL)
    return make_plan(
        load_model(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            dtype=case.dtype,
            kv_cache_dtype=case.kv_cache_dtype,
            enable_prefix_caching=case.enable_prefix_caching,
            max_model_len=case.max_model_len,
            block_size=case.block_size,
            offloader="upstream",
            **kw,
        ),
    )


def vllm_for(cache: LayoutCache, case: Case, plan: Plan):
    built = cache.get(case, plan.gpu.attention_backend)
    if isinstance(built, Exception):
        pytest.fail(f"vLLM refused {case} which the planner accepts: {built!r}")
    return built


def planned_groups(plan: Plan) -> list[dict]:
    """The plan's groups in the harness's description of vLLM's."""
    return [
        {
            "kind": g.kind,
            "layer_indices": g.layer_indices,
            "tokens_per_block": g.tokens_per_block,
            "page_bytes": g.page_bytes,
            "sliding_window": g.sliding_window,
        }
        for g in plan.kv_groups
    ]


def test_pinned_version():
    assert VLLM_VERSION == "0.33.0"


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_kv_groups_match_vllm(case: Case, vllm_layouts: LayoutCache):
    plan = plan_for(case)
    built = vllm_for(vllm_layouts, case, plan)
    assert planned_groups(plan) == built.groups
    assert plan.block_size == built.block_size
    assert plan.model.num_cache_layers == len(built.layer_names)
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": 1})
    assert plan.tokens_per_hash == off["tokens_per_hash"]
    assert plan.worker_bytes_per_block == off["worker_bytes_per_block"]


@pytest.mark.parametrize("bpc", BLOCKS_PER_CHUNK, ids=lambda b: f"bpc{b}")
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_upstream_offload_matches_vllm(case: Case, bpc: int | None, vllm_layouts: LayoutCache):
    plan = plan_for(case, blocks_per_chunk=bpc)
    built = vllm_for(vllm_layouts, case, plan)
    # the default the planner picks is passed explicitly: vLLM's own default is 1
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    up = plan.upstream
    assert up is not None
    assert plan.kv_connector_extra_config == {
        "cpu_bytes_to_use": POOL,
        "blocks_per_chunk": off["blocks_per_chunk"],
    }
    assert up.replicated_layout == off["replicated_layout"]
    assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
    assert up.gauge_tokens == off["gauge_tokens"]
    assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
    assert [g.window_chunks for g in up.groups] == off["window_chunks"]


@pytest.mark.parametrize("case", LAYOUT_CASES[::3], ids=str)
def test_pool_below_one_row_is_refused(case: Case, vllm_layouts: LayoutCache):
    plan = plan_for(case)
    built = vllm_for(vllm_layouts, case, plan)
    tiny = plan.upstream.row_bytes - 1
    off = built.offload({"cpu_bytes_to_use": tiny, "blocks_per_chunk": plan.blocks_per_chunk})
    assert off["num_chunks"] == 0  # vLLM starts, but every store would fail
    with pytest.raises(PlanRefused, match="smaller than one row"):
        plan_for(case, cpu_memory_bytes=tiny)


@pytest.mark.parametrize(
    ("extra", "planner_kw", "match"),
    [
        ({"blocks_per_chunk": 0}, {"blocks_per_chunk": 0}, "greater than 0"),
        ({"blocks_per_chunk": -2}, {"blocks_per_chunk": -2}, "greater than 0"),
        (
            {"blocks_per_chunk": 4, "block_size": 64},
            {"blocks_per_chunk": 4, "chunk_block_size_tokens": 64},
            "not both",
        ),
        ({"block_size": 100}, {"chunk_block_size_tokens": 100}, "multiple of the GPU block"),
    ],
)
def test_extra_config_errors_match(extra, planner_kw, match, vllm_layouts: LayoutCache):
    case = Case("llama-3.2-1b")
    plan = plan_for(case)
    built = vllm_for(vllm_layouts, case, plan)
    with pytest.raises(ValueError):
        built.offload({"cpu_bytes_to_use": POOL, **extra})
    with pytest.raises(PlanRefused, match=match):
        plan_for(case, **planner_kw)


def test_token_block_size_key_accepted_like_vllm(vllm_layouts: LayoutCache):
    case = Case("gemma-3-27b-it")
    plan = plan_for(case, chunk_block_size_tokens=256)
    built = vllm_for(vllm_layouts, case, plan)
    off = built.offload({"cpu_bytes_to_use": POOL, "block_size": 256})
    assert plan.upstream.blocks_per_chunk == off["blocks_per_chunk"] == 16
    assert plan.upstream.row_bytes == off["row_bytes"]


def test_mamba_hybrid_without_prefix_caching_is_refused(vllm_layouts: LayoutCache):
    case = Case("qwen3-next-80b-a3b-instruct", enable_prefix_caching=False)
    plan = plan_for(Case("qwen3-next-80b-a3b-instruct"))  # the backend vLLM picks
    built = vllm_layouts.get(case, plan.gpu.attention_backend)
    assert not isinstance(built, Exception), built
    with pytest.raises(AssertionError, match="tokens_per_hash"):
        built.offload({"cpu_bytes_to_use": POOL})
    with pytest.raises(PlanRefused, match="hash unit"):
        plan_for(case)


def test_indivisible_tensor_parallel_refused_by_both(vllm_layouts: LayoutCache):
    case = Case("llama-3.2-1b", 3)
    built = vllm_layouts.get(case, "FLASH_ATTN")
    assert isinstance(built, Exception)
    assert "divisible" in str(built)
    with pytest.raises(PlanRefused, match="divisible"):
        plan_for(case)


def test_max_model_len_beyond_context_refused_by_both(vllm_layouts: LayoutCache):
    case = Case("phi-3-mini-4k-instruct", max_model_len=8192)
    built = vllm_layouts.get(case, "FLASH_ATTN")
    assert isinstance(built, Exception)
    assert "max_model_len" in str(built)
    with pytest.raises(PlanRefused, match="context length 4096"):
        plan_for(case)


@pytest.mark.parametrize(
    "model",
    [
        "llama-3.1-70b-instruct",
        "gemma-3-27b-it",
        "gemma-2-9b",
        "gpt-oss-120b",
        "deepseek-v3",
        "qwen3-next-80b-a3b-instruct",
        "jamba-mini-1.5",
        "nemotron-h-8b-base-8k",
        "phi-3-mini-4k-instruct",
    ],
)
def test_default_max_model_len_matches_vllm(model: str):
    plan = make_plan(load_model(model), PlanRequest(cpu_memory_bytes=POOL))
    assert plan.max_model_len == vllm_default_max_model_len(load_model(model))
