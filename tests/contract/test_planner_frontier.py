"""The 2026 frontier: hybrid KV layouts of vLLM 0.33.0's newer architectures.

Each case plans a released model's public config.json facts (``frontier_configs/``,
sources in its README) with the planner and with vLLM's own code on the CPU, and
asserts the two agree: KV groups, block size, hash unit, bytes per block and the
upstream offloader's rows. An architecture the planner refuses is either refused by
vLLM at the same place, or listed in ``NOT_YET_MODELLED`` with the reason, and the
test checks the planner says so by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from spillway_engine.planner.families import SUPPORTED_ARCHITECTURES
from spillway_engine.planner.plan import Plan, PlanRefused, PlanRequest, make_plan

from .vllm_harness import (
    Case,
    VllmLayout,
    build_layout,
    kernel_block_sizes,
    vllm_default_max_model_len,
)

CONFIGS = Path(__file__).resolve().parent / "frontier_configs"
GIB = 2**30
POOL = 64 * GIB


FIRST_SET = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def load_frontier(name: str) -> dict[str, Any]:
    """A frontier fixture, or one of the first set (``tests/fixtures/models``)."""
    path = CONFIGS / f"{name}.json"
    if not path.exists():
        path = FIRST_SET / f"{name}.json"
    return json.loads(path.read_text())["config"]


class FrontierLayouts:
    """vLLM layouts built once per case for the session; a refusal is kept as a result."""

    def __init__(self) -> None:
        self._built: dict[Case, VllmLayout | Exception] = {}

    def get(self, case: Case, attention_backend: str | None) -> VllmLayout | Exception:
        if case not in self._built:
            try:
                self._built[case] = build_layout(load_frontier(case.model), case, attention_backend)
            except Exception as e:  # vLLM refusing is a result too
                self._built[case] = e
        return self._built[case]


@pytest.fixture(scope="session")
def frontier_layouts() -> FrontierLayouts:
    return FrontierLayouts()


KIMI = "kimi-linear-48b-a3b"
GRANITE = "granite-4.0-h-small"
QWEN35 = "qwen3.5-35b-a3b"
MINIMAX = "minimax-m2"
OLMO3 = "olmo-3-7b"
STEP35 = "step-3.5-flash"
GEMMA4 = "gemma-4-31b"
GEMMA4_E2B = "gemma-4-e2b"

LAYOUT_CASES = [
    # linear attention (KDA) + MLA: the block grows to 128-aligned tokens so one MLA
    # page holds a KDA state; 20 KDA layers split into 3 groups beside 7 MLA layers
    Case(KIMI, max_model_len=4096),
    Case(KIMI, 2, max_model_len=4096),
    Case(KIMI, 4, max_model_len=4096),
    Case(KIMI, 8, max_model_len=4096),
    Case(KIMI, 2, gpu="a100", max_model_len=4096),
    Case(KIMI, kv_cache_dtype="fp8", max_model_len=4096),
    Case(KIMI, 4, kv_cache_dtype="fp8", max_model_len=4096),
    # Mamba-2 + NoPE attention, 36:4
    Case(GRANITE, max_model_len=2048),
    Case(GRANITE, 2, max_model_len=2048),
    Case(GRANITE, 4, max_model_len=2048),
    Case(GRANITE, 8, max_model_len=2048),
    Case(GRANITE, 2, gpu="a100", max_model_len=2048),
    Case(GRANITE, kv_cache_dtype="fp8", max_model_len=2048),
    Case(GRANITE, 4, kv_cache_dtype="fp8", max_model_len=2048),
    # Gated DeltaNet + gated full attention, 3:1, float32 SSM state from the config
    Case(QWEN35),
    Case(QWEN35, 2),
    Case(QWEN35, 4),  # 2 KV heads over 4 ranks: replicated
    Case(QWEN35, 8),
    Case(QWEN35, 2, gpu="a100"),
    Case(QWEN35, kv_cache_dtype="fp8"),
    Case(QWEN35, 4, kv_cache_dtype="fp8"),
    # full attention on every layer, 8 KV heads
    Case(MINIMAX, 4),
    Case(MINIMAX, 8),
    Case(MINIMAX, 16),  # 8 KV heads over 16 ranks: replicated
    Case(MINIMAX, 8, kv_cache_dtype="fp8"),
    # sliding window (3 of 4 layers) + full, served by vLLM's Transformers backend
    Case(OLMO3),
    Case(OLMO3, 2),
    Case(OLMO3, 4, gpu="a100"),
    Case(OLMO3, kv_cache_dtype="fp8"),
    # sliding window + full with different query heads, one KV-head count
    Case(STEP35, 4),
    Case(STEP35, 8),
    Case(STEP35, 8, kv_cache_dtype="fp8"),
    # sliding (16 kv x 256) + full (4 kv x 512): the full layers' blocks double to 32
    # tokens so both pages match; Ampere/Ada only (see test_gemma4_on_hopper_is_refused)
    Case(GEMMA4, gpu="a100"),
    Case(GEMMA4, 2, gpu="a100"),
    Case(GEMMA4, 8, gpu="a100"),  # 4 global KV heads over 8 ranks: replicated
    Case(GEMMA4, 2, gpu="l40s", kv_cache_dtype="fp8"),
    # KV sharing: 20 of 35 layers own no cache
    Case(GEMMA4_E2B, gpu="a100"),
    Case(GEMMA4_E2B, 2, gpu="a100"),
]
# Speculative decoding with the model's own MTP heads: the drafter's layers join the
# target's groups (a full-attention MTP layer beside the GDN states; an MLA MTP layer
# beside the latents) and Mamba convolution states keep a row per draft token.
MTP_CASES = [
    Case(QWEN35, speculative_method="mtp", num_speculative_tokens=1),
    Case(QWEN35, 2, speculative_method="mtp", num_speculative_tokens=3),
    Case(QWEN35, 4, gpu="a100", speculative_method="mtp", num_speculative_tokens=2),
    Case(QWEN35, 2, kv_cache_dtype="fp8", speculative_method="mtp", num_speculative_tokens=1),
    Case("deepseek-v3", 8, speculative_method="mtp", num_speculative_tokens=1),
    Case("deepseek-v3", 8, speculative_method="mtp", num_speculative_tokens=3),
]
LAYOUT_CASES += MTP_CASES
BLOCKS_PER_CHUNK = [None, 1, 4]


def plan_for(case: Case, **kw: Any) -> Plan:
    kw.setdefault("cpu_memory_bytes", POOL)
    return make_plan(
        load_frontier(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            dtype=case.dtype,
            kv_cache_dtype=case.kv_cache_dtype,
            enable_prefix_caching=case.enable_prefix_caching,
            max_model_len=case.max_model_len,
            block_size=case.block_size,
            speculative_method=case.speculative_method,
            num_speculative_tokens=case.num_speculative_tokens,
            offloader="upstream",
            **kw,
        ),
    )


#: vLLM's TRITON_ATTN has the FLASH_ATTN stand-in's kernel block rule (MultipleOf(16));
#: the harness knows the stand-ins by the names it was written for.
STAND_IN = {"TRITON_ATTN": "FLASH_ATTN"}


def vllm_for(layouts: FrontierLayouts, case: Case, plan: Plan) -> VllmLayout:
    backend = plan.gpu.attention_backend
    built = layouts.get(case, STAND_IN.get(backend or "", backend))
    if isinstance(built, Exception):
        pytest.fail(f"vLLM refused {case} which the planner accepts: {built!r}")
    return built


def planned_groups(plan: Plan) -> list[dict[str, Any]]:
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


def test_frontier_architectures_are_supported():
    for arch in (
        "MiniMaxM2ForCausalLM",
        "Olmo3ForCausalLM",
        "Step3p5ForCausalLM",
        "Gemma4ForCausalLM",
        "KimiLinearForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    ):
        assert arch in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_kv_groups_match_vllm(case: Case, frontier_layouts: FrontierLayouts):
    plan = plan_for(case)
    built = vllm_for(frontier_layouts, case, plan)
    assert planned_groups(plan) == built.groups
    assert plan.block_size == built.block_size
    assert plan.model.num_cache_layers == len(built.layer_names)
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": 1})
    assert plan.tokens_per_hash == off["tokens_per_hash"]
    assert plan.worker_bytes_per_block == off["worker_bytes_per_block"]


@pytest.mark.parametrize("bpc", BLOCKS_PER_CHUNK, ids=lambda b: f"bpc{b}")
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_upstream_offload_matches_vllm(
    case: Case, bpc: int | None, frontier_layouts: FrontierLayouts
):
    plan = plan_for(case, blocks_per_chunk=bpc)
    built = vllm_for(frontier_layouts, case, plan)
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


def test_kimi_linear_groups_differ_in_kind_but_share_one_page():
    """The per-group offloader's case: KDA state groups padded to the MLA page."""
    plan = plan_for(Case(KIMI, max_model_len=4096))
    kinds = [g.kind for g in plan.kv_groups]
    assert kinds.count("mamba") == 3 and kinds.count("mla") == 1
    assert len({g.page_bytes for g in plan.kv_groups}) == 1
    assert plan.block_size % 128 == 0


@pytest.mark.parametrize("tp", [3, 5])
def test_indivisible_tensor_parallel_refused_by_both(tp: int, frontier_layouts: FrontierLayouts):
    for model, max_len in ((QWEN35, 8192), (GRANITE, 2048)):
        case = Case(model, tp, max_model_len=max_len)
        built = frontier_layouts.get(case, "FLASH_ATTN")
        assert isinstance(built, Exception), f"vLLM accepted {case}"
        assert "divisible" in str(built)
        with pytest.raises(PlanRefused, match="divisible"):
            plan_for(case)


@pytest.mark.parametrize(
    "model", [KIMI, GRANITE, QWEN35, MINIMAX, OLMO3, STEP35, GEMMA4, GEMMA4_E2B]
)
def test_default_max_model_len_matches_vllm(model: str):
    # A100: Gemma 4 is planned on Ampere/Ada only; the context does not depend on the GPU
    plan = make_plan(load_frontier(model), PlanRequest(cpu_memory_bytes=POOL, gpu="a100"))
    assert plan.max_model_len == vllm_default_max_model_len(load_frontier(model))


def test_gemma4_full_layers_take_their_own_heads_and_bigger_blocks():
    plan = plan_for(Case(GEMMA4, gpu="a100"))
    assert plan.gpu.attention_backend == "TRITON_ATTN"
    full = [g for g in plan.kv_groups if g.kind == "full_attention"]
    sliding = [g for g in plan.kv_groups if g.kind == "sliding_window"]
    assert {g.tokens_per_block for g in full} == {32}
    assert {g.tokens_per_block for g in sliding} == {16}


@pytest.mark.parametrize("case", MTP_CASES, ids=str)
def test_mtp_plan_records_the_draft_layers(case: Case, frontier_layouts: FrontierLayouts):
    plan = plan_for(case)
    built = vllm_for(frontier_layouts, case, plan)
    without = plan_for(Case(case.model, case.tensor_parallel_size, case.gpu, case.kv_cache_dtype))
    own = without.model.num_cache_layers
    assert plan.speculative_method == "mtp"
    assert plan.draft_layer_indices == list(range(own, len(built.layer_names)))
    assert plan.draft_layer_indices  # the drafter adds cache layers
    grouped = {i for g in plan.kv_groups for i in g.layer_indices}
    assert set(plan.draft_layer_indices) <= grouped


def test_mtp_on_a_model_without_mtp_layers_is_refused():
    with pytest.raises(PlanRefused, match="no MTP layers"):
        plan_for(Case(OLMO3, speculative_method="mtp", num_speculative_tokens=1))


# Speculative decoding with a separate drafter: a draft model (its own config.json, the
# target's vocabulary) or an EAGLE-3 head. vLLM builds the drafter into the target's
# forward context after the target's layers; a draft layer with the target's heads joins
# the target's group, one with other heads makes one full-attention group of mixed pages
# (UniformTypeKVCacheSpecs), whose block holds each layer's own page.
LLAMA31_8B = "llama-3.1-8b-instruct"
LLAMA31_70B = "llama-3.1-70b-instruct"
LLAMA32_1B = "llama-3.2-1b"
EAGLE3_LLAMA31_8B = "eagle3-llama3.1-instruct-8b"
QWEN3_8B = "qwen3-8b"
QWEN3_06B = "qwen3-0.6b"
MISTRAL = "mistral-7b-v0.1"
TINYLLAMA = "tinyllama-1.1b-chat"
GPT_OSS_120B = "gpt-oss-120b"
GPT_OSS_20B = "gpt-oss-20b"


def _drafted(model: str, tp: int, method: str, tokens: int, draft: str, **kw: Any) -> Case:
    return Case(
        model,
        tp,
        speculative_method=method,
        num_speculative_tokens=tokens,
        draft_model=draft,
        **kw,
    )


DRAFTER_CASES = [
    # EAGLE-3 head with the target's page: one more layer in the one group
    _drafted(LLAMA31_8B, 1, "eagle3", 3, EAGLE3_LLAMA31_8B),
    _drafted(LLAMA31_8B, 2, "eagle3", 1, EAGLE3_LLAMA31_8B),
    _drafted(LLAMA31_8B, 4, "eagle3", 5, EAGLE3_LLAMA31_8B, gpu="a100"),
    _drafted(LLAMA31_8B, 8, "eagle3", 3, EAGLE3_LLAMA31_8B, kv_cache_dtype="fp8"),
    # Qwen3-0.6B drafts for Qwen3-8B: same 8 x 128 page, 28 layers join the 36
    _drafted(QWEN3_8B, 1, "draft_model", 4, QWEN3_06B),
    _drafted(QWEN3_8B, 2, "draft_model", 4, QWEN3_06B),
    _drafted(QWEN3_8B, 8, "draft_model", 2, QWEN3_06B, kv_cache_dtype="fp8"),
    _drafted(QWEN3_8B, 16, "draft_model", 4, QWEN3_06B),  # 8 KV heads over 16: replicated
    # Llama-3.2-1B (8 x 64) drafts for Llama-3.1 (8 x 128): one group, two page sizes
    _drafted(LLAMA31_8B, 1, "draft_model", 5, LLAMA32_1B),
    _drafted(LLAMA31_8B, 2, "draft_model", 5, LLAMA32_1B, gpu="a100"),
    _drafted(LLAMA31_8B, 4, "draft_model", 3, LLAMA32_1B, kv_cache_dtype="fp8"),
    _drafted(LLAMA31_70B, 8, "draft_model", 5, LLAMA32_1B),
    # an MoE target (4 KV heads) with a dense draft (8): pages differ once TP splits them
    _drafted("qwen3-30b-a3b", 4, "draft_model", 3, QWEN3_06B),
    _drafted("qwen3-30b-a3b", 2, "draft_model", 3, QWEN3_06B, kv_cache_dtype="fp8"),
    # an all-sliding target (Mistral-7B, window 4096): the draft's layers take its cache
    # window (CacheConfig.sliding_window) and join one sliding group of mixed pages
    _drafted(MISTRAL, 1, "draft_model", 4, TINYLLAMA, max_model_len=8192),
    _drafted(MISTRAL, 2, "draft_model", 4, TINYLLAMA, max_model_len=8192),
    _drafted(MISTRAL, 4, "draft_model", 2, TINYLLAMA, max_model_len=8192, kv_cache_dtype="fp8"),
    # sliding (128) + full alternating: gpt-oss-20b's layers (the 120b's page and window)
    # join the 120b's two groups, 30 layers each
    _drafted(GPT_OSS_120B, 1, "draft_model", 3, GPT_OSS_20B),
    _drafted(GPT_OSS_120B, 2, "draft_model", 3, GPT_OSS_20B),
    _drafted(GPT_OSS_120B, 8, "draft_model", 3, GPT_OSS_20B),
]


class DrafterLayouts:
    """vLLM layouts of the drafter cases, built once per session; refusals kept."""

    def __init__(self) -> None:
        self._built: dict[Case, VllmLayout | Exception] = {}

    def get(self, case: Case, attention_backend: str | None) -> VllmLayout | Exception:
        if case not in self._built:
            assert case.draft_model is not None
            try:
                self._built[case] = build_layout(
                    load_frontier(case.model),
                    case,
                    attention_backend,
                    draft_config=load_frontier(case.draft_model),
                )
            except Exception as e:  # vLLM refusing is a result too
                self._built[case] = e
        return self._built[case]


@pytest.fixture(scope="session")
def drafter_layouts() -> DrafterLayouts:
    return DrafterLayouts()


def drafted_plan(case: Case, **kw: Any) -> Plan:
    """The plan of a drafter case: the drafter's config.json goes to make_plan."""
    assert case.draft_model is not None
    kw.setdefault("cpu_memory_bytes", POOL)
    return make_plan(
        load_frontier(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            kv_cache_dtype=case.kv_cache_dtype,
            max_model_len=case.max_model_len,
            speculative_method=case.speculative_method,
            num_speculative_tokens=case.num_speculative_tokens,
            speculative_model=case.draft_model,
            offloader="upstream",
            **kw,
        ),
        load_frontier(case.draft_model),
    )


def vllm_drafted(layouts: DrafterLayouts, case: Case, plan: Plan) -> VllmLayout:
    backend = plan.gpu.attention_backend
    built = layouts.get(case, STAND_IN.get(backend or "", backend))
    if isinstance(built, Exception):
        pytest.fail(f"vLLM refused {case} which the planner accepts: {built!r}")
    return built


def planned_groups_as_vllm(plan: Plan) -> list[dict[str, Any]]:
    """``planned_groups``, a mixed-page group described as the harness describes it
    (kind ``uniform:...``; the wrapper spec has no window: see ``vllm_windows``)."""
    groups = planned_groups(plan)
    for described, group in zip(groups, plan.kv_groups, strict=True):
        if group.layer_page_bytes:
            described["kind"] = f"uniform:{group.kind}"
            described["sliding_window"] = None
    return groups


def vllm_windows(built: VllmLayout) -> list[set[int | None]]:
    """Each vLLM group's windows, read from its layers' own specs."""
    return [
        {getattr(s, "sliding_window", None)
         for s in getattr(g.kv_cache_spec, "kv_cache_specs", {0: g.kv_cache_spec}).values()}
        for g in built.kv_cache_config.kv_cache_groups
    ]


@pytest.mark.parametrize("case", DRAFTER_CASES, ids=str)
def test_drafter_kv_groups_match_vllm(case: Case, drafter_layouts: DrafterLayouts):
    plan = drafted_plan(case)
    built = vllm_drafted(drafter_layouts, case, plan)
    assert planned_groups_as_vllm(plan) == built.groups
    assert [{g.sliding_window} for g in plan.kv_groups] == vllm_windows(built)
    assert plan.block_size == built.block_size
    assert plan.model.num_cache_layers == len(built.layer_names)
    # the drafter's layers are vLLM's last ones, named by the proposer's prefix
    own = plan_for(Case(case.model, case.tensor_parallel_size, case.gpu, case.kv_cache_dtype))
    assert plan.draft_layer_indices == list(
        range(own.model.num_cache_layers, len(built.layer_names))
    )
    drafted = [built.layer_names[i] for i in plan.draft_layer_indices]
    if case.speculative_method == "draft_model":
        assert all(name.startswith("draft_model.") for name in drafted)
    assert plan.speculative_config() == {
        "method": case.speculative_method,
        "num_speculative_tokens": case.num_speculative_tokens,
        "model": case.draft_model,
    }
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": 1})
    assert plan.tokens_per_hash == off["tokens_per_hash"]
    assert plan.worker_bytes_per_block == off["worker_bytes_per_block"]
    assert sum(g.bytes_per_block for g in plan.kv_groups) >= plan.worker_bytes_per_block


@pytest.mark.parametrize("bpc", BLOCKS_PER_CHUNK, ids=lambda b: f"bpc{b}")
@pytest.mark.parametrize("case", DRAFTER_CASES, ids=str)
def test_drafter_upstream_offload_matches_vllm(
    case: Case, bpc: int | None, drafter_layouts: DrafterLayouts
):
    plan = drafted_plan(case, blocks_per_chunk=bpc)
    built = vllm_drafted(drafter_layouts, case, plan)
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    up = plan.upstream
    assert up is not None
    assert plan.kv_connector_extra_config["blocks_per_chunk"] == off["blocks_per_chunk"]
    assert up.replicated_layout == off["replicated_layout"]
    assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
    assert up.gauge_tokens == off["gauge_tokens"]
    assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
    assert [g.window_chunks for g in up.groups] == off["window_chunks"]


def test_a_draft_model_with_other_heads_adds_a_second_page_size():
    plan = drafted_plan(_drafted(LLAMA31_8B, 2, "draft_model", 5, LLAMA32_1B))
    [group] = plan.kv_groups
    # TP 2: the 8B's layers hold 4 x 128 heads, the 1B's 4 x 64, 16 tokens, bf16, K and V
    assert sorted(set(group.layer_page_bytes)) == [16 * 4 * 64 * 2 * 2, 16 * 4 * 128 * 2 * 2]
    assert group.bytes_per_block == 32 * 32768 + 16 * 16384 == plan.worker_bytes_per_block
    assert plan.draft_layer_indices == list(range(32, 48))


# What vLLM refuses, the planner refuses with the same reason.
DRAFTER_REFUSALS = [
    # the drafter's vocabulary must be the target's (no heterogeneous vocabulary)
    (_drafted(QWEN3_8B, 1, "draft_model", 4, LLAMA32_1B), "same vocabulary size"),
    # Gemma 3's 1B has 64 fewer token rows than the 12B (262144, 262208)
    (_drafted("gemma-3-12b-it", 1, "draft_model", 4, "gemma-3-1b-it"), "vocab_size=262144"),
    # the 70B's 64 heads split over 64 ranks, the 1B draft's 32 do not
    (
        _drafted(LLAMA31_70B, 64, "draft_model", 4, LLAMA32_1B),
        r"Total number of attention heads \(32\) must be divisible by tensor parallel size",
    ),
]


@pytest.mark.parametrize(
    ("case", "reason"), DRAFTER_REFUSALS, ids=[str(c) for c, _ in DRAFTER_REFUSALS]
)
def test_drafter_refused_by_both(case: Case, reason: str, drafter_layouts: DrafterLayouts):
    built = drafter_layouts.get(case, "FLASH_ATTN")
    assert isinstance(built, Exception), f"vLLM accepted {case}"
    assert re.search(reason, str(built))
    with pytest.raises(PlanRefused, match=reason):
        drafted_plan(case)


def test_a_drafter_with_other_heads_beside_a_mix_of_attention_kinds_is_refused():
    """Not a vLLM refusal: beside sliding and full layers, draft layers of another page
    regroup the target's (block sizes unified, buckets split, the hash unit: vLLM
    #48919); no released drafter of that kind was at hand to check against vLLM, so the
    planner says it does not model it (a drafter with the target's heads it does)."""
    other_heads = dict(load_frontier(GPT_OSS_20B), num_key_value_heads=4)
    with pytest.raises(PlanRefused, match="#48919"):
        make_plan(
            load_frontier(GPT_OSS_120B),
            PlanRequest(cpu_memory_bytes=POOL, speculative_method="draft_model",
                        num_speculative_tokens=2),
            other_heads,
        )


def test_a_llama_style_drafter_sliding_without_layer_types_is_refused():
    """vLLM gives such a drafter's layers the target's cache window, not its own."""
    with pytest.raises(PlanRefused, match="without layer_types"):
        make_plan(
            load_frontier(LLAMA31_8B),
            PlanRequest(cpu_memory_bytes=POOL, speculative_method="draft_model",
                        num_speculative_tokens=2),
            dict(load_frontier(LLAMA32_1B), sliding_window=4096),
        )


def test_a_separate_drafter_without_its_config_is_refused():
    for method in ("draft_model", "eagle3"):
        with pytest.raises(PlanRefused, match=r"needs the drafter's config\.json"):
            plan_for(Case(LLAMA31_8B, speculative_method=method, num_speculative_tokens=2))


def test_an_eagle3_head_vllm_builds_with_another_model_file_is_refused():
    head = dict(load_frontier(EAGLE3_LLAMA31_8B), architectures=["Eagle3Qwen3ForCausalLM"])
    request = PlanRequest(
        cpu_memory_bytes=POOL, speculative_method="eagle3", num_speculative_tokens=2
    )
    with pytest.raises(PlanRefused, match="Eagle3Qwen3ForCausalLM"):
        make_plan(load_frontier(LLAMA31_8B), request, head)


@pytest.mark.parametrize(
    "case",
    [c for c in DRAFTER_CASES if c.tensor_parallel_size <= 2],
    ids=str,
)
def test_engine_plan_check_passes_a_drafter_plan(case: Case, drafter_layouts: DrafterLayouts):
    """The engine's start-up check reads vLLM's groups (a mixed-page group included)
    as the plan has them, and a wrong page in the drafter's group is caught."""
    from spillway_engine.launcher import plan_check

    plan = drafted_plan(case)
    built = vllm_drafted(drafter_layouts, case, plan)
    built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    observed = plan_check.observe(built.vllm_config, built.kv_cache_config)
    assert plan_check.compare(plan, observed) == []
    wrong = plan.model_copy(
        update={"kv_groups": [g.model_copy(update={"page_bytes": g.page_bytes + 1})
                              for g in plan.kv_groups]}
    )
    assert [m.field for m in plan_check.compare(wrong, observed)] == [
        f"kv_groups[{i}].page_bytes" for i in range(len(plan.kv_groups))
    ]


# --- DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) and Gemma 4 on Hopper ----------
#
# vLLM builds DSA models on Hopper with sparse-MLA kernels the CPU cannot import
# (FlashAttention's sparse MLA needs CUDA). Reconstructed here: the layers are built by
# vLLM's own model class (on a CPU, ``DeepseekV3ForCausalLM``/``GlmMoeDsaForCausalLM``
# of deepseek_v2.py, whose attention, Indexer and DeepseekV32IndexerCache match the CUDA
# module's) with vLLM's FLASHMLA_SPARSE backend class standing in for
# FLASH_ATTN_MLA_SPARSE (both MultipleOf(64), both align 16-bit blocks to rows; its
# impl needs a workspace, made on the CPU). With fp8_e4m3 the layers get vLLM's own
# FLASHINFER_MLA_SPARSE_SM90 class (it imports on a CPU). The specs are the layers' own
# get_kv_cache_spec customised by those classes, grouped by vLLM's planning code.
DSV32 = "deepseek-v3.2-exp"
GLM5 = "glm-5"
SPARSE_CASES = [
    Case(DSV32),
    Case(DSV32, 2),
    Case(DSV32, 4),
    Case(DSV32, 8),
    Case(DSV32, 8, kv_cache_dtype="fp8"),  # FLASHMLA_SPARSE, fp8_ds_mla 656 B a token
    Case(DSV32, 4, kv_cache_dtype="fp8"),
    # fp8_e4m3 is not FlashMLA's: FlashInfer's SM90 sparse MLA, plain 576 B rows
    Case(DSV32, kv_cache_dtype="fp8_e4m3"),
    Case(DSV32, 2, kv_cache_dtype="fp8_e4m3"),
    Case(DSV32, 4, kv_cache_dtype="fp8_e4m3"),
    Case(DSV32, 8, kv_cache_dtype="fp8_e4m3"),
    Case(DSV32, 8, kv_cache_dtype="fp8_e4m3", gpu="h200"),
    Case(DSV32, 8, kv_cache_dtype="fp8_e4m3", block_size=128),
    Case(DSV32, 8, block_size=128),
    Case(DSV32, 8, gpu="h200"),
    Case(GLM5, 4),
    Case(GLM5, 8),
    Case(GLM5, 8, kv_cache_dtype="fp8"),
    Case(GLM5, 4, kv_cache_dtype="fp8_e4m3"),
    Case(GLM5, 8, kv_cache_dtype="fp8_e4m3", gpu="h200"),
    # MTP heads build a full indexer too: one more key + latent pair in the group
    Case(DSV32, 8, speculative_method="mtp", num_speculative_tokens=1),
    Case(GLM5, 8, speculative_method="mtp", num_speculative_tokens=2),
    Case(DSV32, 4, kv_cache_dtype="fp8_e4m3", speculative_method="mtp",
         num_speculative_tokens=1),
]
# Gemma 4 on Hopper with a 16-bit cache: Gemma4Config forces FA4 (shipped in vLLM's
# vllm_flash_attn/cute) for every layer; its pages are MultipleOf(16) on SM90 (the
# 128-token hd256 pages are SM100/110 only, the 64-token ones FP8 only), so the
# FLASH_ATTN class's rule on a CPU is Hopper's.
GEMMA4_HOPPER_CASES = [
    Case(GEMMA4),
    Case(GEMMA4, 2),
    Case(GEMMA4, 8, gpu="h200"),
    Case(GEMMA4_E2B),
]


def _cpu_workspace() -> None:
    # FlashMLA's sparse impl reserves its prefill workspace when a layer is built.
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))


@pytest.mark.parametrize("case", SPARSE_CASES + GEMMA4_HOPPER_CASES, ids=str)
def test_sparse_and_hopper_groups_match_vllm(case: Case, frontier_layouts: FrontierLayouts):
    plan = plan_for(case)
    _cpu_workspace()
    built = vllm_for(frontier_layouts, case, plan)
    assert planned_groups_as_vllm(plan) == built.groups
    assert plan.block_size == built.block_size
    assert plan.model.num_cache_layers == len(built.layer_names)
    for bpc in BLOCKS_PER_CHUNK:
        planned = plan_for(case, blocks_per_chunk=bpc)
        off = built.offload(
            {"cpu_bytes_to_use": POOL, "blocks_per_chunk": planned.blocks_per_chunk}
        )
        assert planned.tokens_per_hash == off["tokens_per_hash"]
        assert planned.worker_bytes_per_block == off["worker_bytes_per_block"]
        up = planned.upstream
        assert up is not None
        assert up.replicated_layout == off["replicated_layout"]
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
        assert up.gauge_tokens == off["gauge_tokens"]
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]


def test_sparse_mla_layout_is_one_group_of_latents_and_indexer_keys(
    frontier_layouts: FrontierLayouts,
):
    """DeepSeek-V3.2: 61 latents (576 x bf16) and 61 indexer keys (128 uint8 + 4 B of
    scales), one mixed-page MLA group on 64-token blocks; fp8 is FlashMLA's 656 B."""
    plan = plan_for(Case(DSV32, 8))
    assert plan.gpu.attention_backend == "FLASH_ATTN_MLA_SPARSE"
    (group,) = plan.kv_groups
    assert group.kind == "mla" and group.tokens_per_block == 64
    assert group.layer_page_bytes == [132 * 64, 576 * 2 * 64] * 61
    fp8 = plan_for(Case(DSV32, 8, kv_cache_dtype="fp8"))
    assert fp8.gpu.attention_backend == "FLASHMLA_SPARSE"
    assert fp8.kv_groups[0].layer_page_bytes[:2] == [132 * 64, 656 * 64]


@pytest.mark.parametrize("gpu", ["a100", "l40s"])
def test_sparse_mla_off_hopper_is_refused_as_vllm_refuses(gpu: str):
    """vLLM's CUDA selector for MLA on SM8x (platforms/cuda.py, which does not import on a
    CPU) lists the dense MLA backends, which reject use_sparse, then FLASH_ATTN_MLA_SPARSE
    (supports_compute_capability: major == 9, its module needs CUDA), FLASHMLA_SPARSE and
    FLASHINFER_MLA_SPARSE_SM90; none is valid, so vLLM stops with 'No valid attention
    backend found'. The two sparse classes that import on a CPU are asked here."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as B

    cap = DeviceCapability(8, 9 if gpu == "l40s" else 0)
    for backend in (B.FLASHMLA_SPARSE, B.FLASHINFER_MLA_SPARSE_SM90):
        assert not backend.get_class().supports_compute_capability(cap)
        assert backend.get_class().supports_compute_capability(DeviceCapability(9, 0))
    assert not TritonMLABackend.is_sparse()  # the dense MLA backend SM8x would run
    with pytest.raises(PlanRefused, match="No valid attention backend found"):
        plan_for(Case(DSV32, 8, gpu=gpu))


@pytest.mark.parametrize("model", [DSV32, GLM5])
def test_sparse_mla_fp8_e4m3_runs_on_flashinfer_sm90_as_vllm_selects(model: str):
    """fp8_e4m3 with a 576-wide latent (512 + 64 RoPE) on SM90: vLLM's sparse tail is
    FLASH_ATTN_MLA_SPARSE, FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE_SM90 (head 576 keeps
    FlashInfer last); the first is 16-bit only, the second lists fp8 (as fp8_ds_mla) but
    not fp8_e4m3, and FlashInfer's takes it as plain fp8 (MLAAttention keeps the dtype:
    576 B latents, per-tensor scale). The indexer keys stay uint8 (132 B)."""
    import importlib.util
    import inspect

    import torch
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.flashattn_mla_sparse import FlashAttnMLASparseBackend
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Backend as FlashInferSM90,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    # platforms/cuda.py needs libcuda to import: its SM90 order is read as text
    spec = importlib.util.find_spec("vllm.platforms")
    assert spec is not None and spec.origin is not None
    cuda = " ".join((Path(spec.origin).parent / "cuda.py").read_text().split())
    assert cuda.count(
        "sparse_tail = [ AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE, "
        "AttentionBackendEnum.FLASHMLA_SPARSE, ] flashinfer_sparse = "
        "AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM90 if head_size == 512: "
        "sparse_tail.insert(0, flashinfer_sparse) else: sparse_tail.append(flashinfer_sparse)"
    ) == 1
    sm90 = DeviceCapability(9, 0)
    combo = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3",
                 block_size=None, use_mla=True, has_sink=False, use_sparse=True,
                 use_mm_prefix=False, device_capability=sm90)
    assert "FP16/BF16" in (FlashAttnMLASparseBackend.supports_combination(**combo) or "")
    assert not FlashAttnMLASparseBackend.supports_kv_cache_dtype("fp8_e4m3")
    assert not FlashMLASparseBackend.supports_kv_cache_dtype("fp8_e4m3")
    assert FlashMLASparseBackend.supports_kv_cache_dtype("fp8")
    assert FlashInferSM90.supports_kv_cache_dtype("fp8_e4m3")
    assert FlashInferSM90.supports_head_size(576)
    assert FlashInferSM90.supports_compute_capability(sm90)
    assert FlashInferSM90.is_sparse() and FlashInferSM90.is_mla()
    # Its remaining gates: kv_lora_rank 512 and RoPE 0/64 (the configs), and FlashInfer
    # with ckv_scale_arr (vLLM's pinned FlashInfer has it; the CPU lacks only kernels).
    config = load_frontier(model)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    run = inspect.signature(BatchMLAPagedAttentionWrapper.run).parameters
    assert run["ckv_scale_arr"].kind is inspect.Parameter.KEYWORD_ONLY
    assert _canonicalize_sparse_mla_kv_cache_dtype(FlashInferSM90, "fp8_e4m3") == "fp8_e4m3"
    assert _canonicalize_sparse_mla_kv_cache_dtype(FlashMLASparseBackend, "fp8") == "fp8_ds_mla"

    plan = plan_for(Case(model, 8, kv_cache_dtype="fp8_e4m3"))
    assert plan.gpu.attention_backend == "FLASHINFER_MLA_SPARSE_SM90"
    assert plan.block_size == 64
    (group,) = plan.kv_groups
    layers = config["num_hidden_layers"]
    assert group.layer_page_bytes == [132 * 64, 576 * 64] * layers
    assert any("FlashInfer's kernels" in n for n in plan.notes)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3"])
def test_sparse_mla_block_size_off_64_is_refused_as_vllm_refuses(kv_cache_dtype: str):
    """A forced --block-size reaches vLLM's selector; every SM90 sparse-MLA backend runs
    MultipleOf(64) kernel blocks, so 32 leaves none (No valid attention backend found)."""
    from vllm.v1.attention.backends.mla.flashattn_mla_sparse import FlashAttnMLASparseBackend
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Backend,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    for cls in (FlashAttnMLASparseBackend, FlashMLASparseBackend, FlashInferMLASparseSM90Backend):
        assert not cls.supports_block_size(32) and cls.supports_block_size(192)
    with pytest.raises(PlanRefused, match=r"--block-size 32 .*No valid attention backend found"):
        plan_for(Case(DSV32, 8, kv_cache_dtype=kv_cache_dtype, block_size=32))
    assert plan_for(Case(DSV32, 8, kv_cache_dtype=kv_cache_dtype, block_size=192)).block_size == 192


def test_sparse_mla_fp8_e4m3_off_its_head_sizes_is_refused_as_vllm_refuses():
    """A latent neither 512 nor 576 wide with fp8_e4m3: FlashAttention's sparse MLA is
    16-bit only and FlashMLA's and FlashInfer's list heads 576 and 512 only, so vLLM's
    selector finds no backend."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Backend,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    for cls in (FlashMLASparseBackend, FlashInferMLASparseSM90Backend):
        assert sorted(cls.get_supported_head_sizes()) == [512, 576]
    config = {**load_frontier(DSV32), "kv_lora_rank": 256}
    request = PlanRequest(tensor_parallel_size=8, gpu="h100", kv_cache_dtype="fp8_e4m3",
                          cpu_memory_bytes=POOL, offloader="upstream")
    with pytest.raises(PlanRefused, match=r"320-wide latent.*No valid attention backend found"):
        make_plan(config, request)


@pytest.mark.parametrize(
    "case",
    [c for c in DRAFTER_CASES if c.tensor_parallel_size <= 2],
    ids=str,
)
def test_spillway_connector_builds_the_drafter_plans_pool(
    case: Case, drafter_layouts: DrafterLayouts
):
    """Spillway's connector geometry (the function the engine runs) on vLLM's groups with
    the drafter's layers: the chunk span, units per group and pool the plan sized."""
    from spillway_engine.launcher import plan_check
    from spillway_engine.vllm_pins import SPILLWAY_CONNECTOR

    plan = make_plan(
        load_frontier(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            kv_cache_dtype=case.kv_cache_dtype,
            max_model_len=case.max_model_len,
            speculative_method=case.speculative_method,
            num_speculative_tokens=case.num_speculative_tokens,
            speculative_model=case.draft_model,
            cpu_memory_bytes=POOL,
        ),
        load_frontier(case.draft_model),
    )
    assert plan.offloader == "spillway"
    built = vllm_drafted(drafter_layouts, case, plan)
    transfer = built.vllm_config.kv_transfer_config
    saved = transfer.kv_connector, transfer.kv_connector_extra_config
    transfer.kv_connector = SPILLWAY_CONNECTOR
    transfer.kv_connector_extra_config = dict(plan.spillway.kv_connector_extra_config)
    try:
        observed = plan_check.observe(built.vllm_config, built.kv_cache_config)
    finally:
        transfer.kv_connector, transfer.kv_connector_extra_config = saved
    assert observed.offload_error is None
    assert plan_check.compare(plan, observed) == []
    assert observed.num_units == plan.spillway.num_units > 0


@pytest.mark.parametrize(
    "case", [Case(DSV32, 8), Case(DSV32, 8, kv_cache_dtype="fp8"), Case(GLM5, 4)], ids=str
)
def test_spillway_pool_of_a_mixed_page_group_is_planned_alike_on_scheduler_and_workers(
    case: Case, frontier_layouts: FrontierLayouts, monkeypatch: pytest.MonkeyPatch
):
    """EngineCore hands the scheduler (and so the connector's scheduler side) a copy of
    the KV config whose mixed-page group carries one layer's spec (here an indexer
    key's page); Spillway's connector must still size the pool as the workers and the
    plan do, or the two sides would disagree on every unit."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from spillway_engine.offloader import geometry as geometry_module
    from spillway_engine.offloader.geometry import build_geometry, with_extra_config

    # replicated MLA ranks share one /dev/shm region on CUDA (the check is CUDA-only)
    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    plan = plan_for(case)  # the backend for the harness
    spillway = make_plan(
        load_frontier(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            kv_cache_dtype=case.kv_cache_dtype,
            max_model_len=case.max_model_len,
            cpu_memory_bytes=POOL,
            offloader="spillway",
        ),
    )
    _cpu_workspace()
    built = vllm_for(frontier_layouts, case, plan)
    vc = with_extra_config(built.vllm_config, dict(spillway.kv_connector_extra_config))
    workers = build_geometry(vc, built.kv_cache_config).layout
    scheduler_copy = generate_scheduler_kv_cache_config([built.kv_cache_config])
    assert scheduler_copy.kv_cache_groups[0].kv_cache_spec.page_size_bytes < (
        built.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    )
    scheduler = build_geometry(vc, scheduler_copy).layout
    assert (scheduler.unit_bytes, scheduler.num_units) == (workers.unit_bytes, workers.num_units)
    assert (spillway.spillway.unit_bytes, spillway.spillway.num_units) == (
        workers.unit_bytes,
        workers.num_units,
    )
    assert [g.chunk_bytes for g in spillway.spillway.groups] == [
        g.chunk_bytes for g in workers.groups
    ]


# --- Gemma 4 with an FP8 KV cache on Hopper --------------------------------------------
#
# Gemma4Config leaves FlashAttention's version to each layer then: FA3 on the head-256
# sliding layers, FA4 on the head-512 full layers (FA3 stops at 256), whose SM90
# FP8-dequant kernel takes exactly 64-token pages. The model's head size is its largest
# (ModelArchitectureConfig.from_layers), so 64 is also the preferred block. Reconstructed
# here: the CPU reports no SM90, so the layers get FlashAttentionSm90StandIn (the
# FLASH_ATTN class with that one SM90 rule, checked against the real class below); the
# layers, their specs, the grouping and the worker's kernel-block choice are vLLM's.
GEMMA4_HOPPER_FP8_CASES = [
    Case(GEMMA4, kv_cache_dtype="fp8"),
    Case(GEMMA4, 2, kv_cache_dtype="fp8"),
    Case(GEMMA4, 4, gpu="h200", kv_cache_dtype="fp8"),
    Case(GEMMA4, 8, kv_cache_dtype="fp8"),  # pages equal: full blocks stay at 64
    Case(GEMMA4, 2, kv_cache_dtype="fp8_e4m3"),
    Case(GEMMA4, 2, kv_cache_dtype="fp8", block_size=128),
    Case(GEMMA4_E2B, kv_cache_dtype="fp8"),  # full page larger: sliding blocks 128
    Case(GEMMA4_E2B, 2, gpu="h200", kv_cache_dtype="fp8"),
]


@pytest.mark.parametrize("case", GEMMA4_HOPPER_FP8_CASES, ids=str)
def test_gemma4_fp8_on_hopper_matches_vllm(case: Case, frontier_layouts: FrontierLayouts):
    plan = plan_for(case)
    assert plan.gpu.attention_backend == "FLASH_ATTN"
    built = vllm_for(frontier_layouts, case, plan)
    assert planned_groups_as_vllm(plan) == built.groups
    assert plan.block_size == built.block_size == (case.block_size or 64)
    assert plan.model.num_cache_layers == len(built.layer_names)
    # the worker splits each group into kernel pages: the full (head-512) groups into
    # FA4's 64-token FP8 pages, the sliding ones not at all
    kernels = kernel_block_sizes(built)
    for group, kernel in zip(plan.kv_groups, kernels, strict=True):
        expected = 64 if group.kind == "full_attention" else group.tokens_per_block
        assert kernel == expected
    for bpc in BLOCKS_PER_CHUNK:
        planned = plan_for(case, blocks_per_chunk=bpc)
        off = built.offload(
            {"cpu_bytes_to_use": POOL, "blocks_per_chunk": planned.blocks_per_chunk}
        )
        assert planned.tokens_per_hash == off["tokens_per_hash"]
        assert planned.worker_bytes_per_block == off["worker_bytes_per_block"]
        up = planned.upstream
        assert up is not None
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
        assert up.gauge_tokens == off["gauge_tokens"]
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
        assert [g.window_chunks for g in up.groups] == off["window_chunks"]


def test_sm90_stand_in_has_flash_attention_s_own_sm90_rule(monkeypatch: pytest.MonkeyPatch):
    """FlashAttentionSm90StandIn against the real FlashAttentionBackend with the platform
    reporting SM90 and FlashAttention's version resolved as on SM90 with FA4 shipped
    (fa_utils: FA3, upgraded to FA4 past head 256)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, get_kv_quant_mode

    from spillway_engine.emulator.backends import FlashAttentionSm90StandIn

    def sm90_version(*args: Any, head_size: int | None = None, **kw: Any) -> int:
        return 4 if head_size is not None and head_size > 256 else 3

    monkeypatch.setattr(flash_attn, "get_flash_attn_version", sm90_version)
    monkeypatch.setattr(
        type(current_platform), "is_device_capability_family", classmethod(lambda c, f: f == 90)
    )
    seen = set()
    for head in (256, 512):
        for dtype in ("auto", "fp8", "fp8_e4m3"):
            for spec_cls in (FullAttentionSpec, SlidingWindowSpec):
                kw = {"sliding_window": 1024} if spec_cls is SlidingWindowSpec else {}
                spec = spec_cls(
                    block_size=16, num_kv_heads=2, head_size=head, dtype=torch.bfloat16,
                    kv_quant_mode=get_kv_quant_mode(dtype), **kw,
                )
                real = flash_attn.FlashAttentionBackend.get_supported_kernel_block_sizes(spec)
                assert FlashAttentionSm90StandIn.get_supported_kernel_block_sizes(spec) == real
                seen.add(str(real))
    assert len(seen) == 2  # both rules were exercised: [64] and MultipleOf(16)


def test_gemma4_fp8_on_hopper_with_a_block_off_64_is_refused(
    frontier_layouts: FrontierLayouts,
):
    """--block-size 32: FlashAttention's class-level rule (the model's head 512, FP8) takes
    multiples of 64 only, so vLLM's selector marks FLASH_ATTN invalid for every layer and
    picks another backend; the planner does not model that fallback and says so."""
    from vllm.config import set_current_vllm_config

    from spillway_engine.emulator.backends import FlashAttentionSm90StandIn

    built = vllm_for(frontier_layouts, Case(GEMMA4, 2, kv_cache_dtype="fp8"), plan_for(
        Case(GEMMA4, 2, kv_cache_dtype="fp8")))
    with set_current_vllm_config(built.vllm_config):
        assert not FlashAttentionSm90StandIn.supports_block_size(32)
        assert FlashAttentionSm90StandIn.supports_block_size(128)
    with pytest.raises(PlanRefused, match="selector falls back"):
        plan_for(Case(GEMMA4, 2, kv_cache_dtype="fp8", block_size=32))
