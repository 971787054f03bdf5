"""GLM-5 Next (``Glm5NextForCausalLM``) against vLLM 0.33.0's own planning code.

vLLM builds it on Hopper with sparse-MLA and FlashKDA kernels the CPU cannot import.
Reconstructed as for DeepSeek-V3.2 (``test_planner_frontier.py``): vLLM's own
``Glm5NextForCausalLM`` class is built on the meta device (its KDA layers, kpool indexer
caches, tail rings and MLA latents are the CUDA module's), FLASHMLA_SPARSE stands in for
FLASH_ATTN_MLA_SPARSE on the latents (both MultipleOf(64), both align 16-bit blocks to
rows), the layers keep their own indexer and ring backends, the KV layout is resolved
from those backends as the worker does (the kpool tail's backend declares only BLHNC),
and vLLM groups, packs and sizes the blocks and the offloader. The fixture is built from
transformers' ``Glm5NextTextConfig`` defaults (no released config.json was reachable;
``frontier_configs/README.md``).

Not reproduced on the CPU: FlashKDA's prefill checkpoints (``kda_prefill_backend``
resolves to Triton here). On Hopper the KDA spec then carries one prefill checkpoint block
per request (every 16 tokens); the layer declares no ``get_prefill_checkpoint_alignment``,
so the platform's block alignment, the pages and the groups are as on the CPU;
``test_flashkda_checkpoints_leave_the_block_alone`` checks that on vLLM's classes.
"""

from __future__ import annotations

from typing import Any

import pytest

from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan

from .test_planner_frontier import (
    BLOCKS_PER_CHUNK,
    POOL,
    FrontierLayouts,
    _cpu_workspace,
    load_frontier,
    plan_for,
    planned_groups_as_vllm,
    vllm_for,
)
from .vllm_harness import Case, build_layout

GLM5NEXT = "glm-5.3-flash"


@pytest.fixture(scope="module")
def layouts() -> FrontierLayouts:
    """vLLM's layouts, built once per case for this module."""
    return FrontierLayouts()

CASES = [
    Case(GLM5NEXT),
    Case(GLM5NEXT, 2),
    Case(GLM5NEXT, 4),
    Case(GLM5NEXT, 8),
    Case(GLM5NEXT, 8, gpu="h200"),
    Case(GLM5NEXT, 2, block_size=1024),  # forced block: aligned to 3 x 1024 tokens
    Case(GLM5NEXT, 4, max_model_len=32768),
    # fp8 latents on FlashInfer's SM90 sparse MLA: 512 B rows, so larger blocks
    Case(GLM5NEXT, 1, kv_cache_dtype="fp8"),
    Case(GLM5NEXT, 2, kv_cache_dtype="fp8"),
    Case(GLM5NEXT, 4, kv_cache_dtype="fp8"),
    Case(GLM5NEXT, 8, kv_cache_dtype="fp8"),
    Case(GLM5NEXT, 4, kv_cache_dtype="fp8_e4m3", gpu="h200"),
]


def test_glm5next_is_planned_not_refused_by_name():
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    from spillway_engine.planner.families import NOT_YET_MODELLED, SUPPORTED_ARCHITECTURES

    assert "Glm5NextForCausalLM" in _TEXT_GENERATION_MODELS
    assert "Glm5NextForCausalLM" in SUPPORTED_ARCHITECTURES
    assert "Glm5NextForCausalLM" not in NOT_YET_MODELLED


def _as_vllm(plan: Any) -> list[dict[str, Any]]:
    """The plan's groups as the harness names vLLM's (a ring group by its spec class)."""
    groups = planned_groups_as_vllm(plan)
    for described in groups:
        if described["kind"] == "uniform:circular_buffer":
            described["kind"] = "uniform:CircularBufferSpec"
    return groups


@pytest.mark.parametrize("case", CASES, ids=str)
def test_glm5next_groups_and_offload_match_vllm(case: Case, layouts: FrontierLayouts):
    plan = plan_for(case)
    _cpu_workspace()
    built = vllm_for(layouts, case, plan)
    assert built.vllm_config.cache_config.kv_cache_layout == "BLHNC"
    assert _as_vllm(plan) == built.groups
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
        # the ring group is not offloaded: only the prefix-cacheable groups have chunks
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
        assert [g.window_chunks for g in up.groups] == off["window_chunks"]


def test_engine_plan_check_passes_the_packed_plan(layouts: FrontierLayouts):
    """The engine's start-up check reads vLLM's packed groups (one-page KDA groups, the
    mixed MLA group, the ring) as the plan has them, and catches a wrong page."""
    from spillway_engine.launcher import plan_check

    case = Case(GLM5NEXT, 2)
    plan = plan_for(case)
    _cpu_workspace()
    built = vllm_for(layouts, case, plan)
    built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    observed = plan_check.observe(built.vllm_config, built.kv_cache_config)
    assert [g.kind for g in observed.groups] == (
        ["uniform(mamba)"] * 4 + ["uniform(mla)", "uniform(circular_buffer)"]
    )
    assert plan_check.compare(plan, observed) == []
    wrong = plan.model_copy(
        update={"kv_groups": [g.model_copy(update={"page_bytes": g.page_bytes + 1})
                              for g in plan.kv_groups]}
    )
    assert [m.field for m in plan_check.compare(wrong, observed)] == [
        f"kv_groups[{i}].page_bytes" for i in range(len(plan.kv_groups))
    ]


def test_glm5next_layout_is_kda_groups_mla_with_pooled_keys_and_an_unhashed_ring():
    """TP 1: 34 KDA states pad to the 4,608-token MLA page (1,024 B a token); each of
    the 11 MLA layers packs a 288-state indexer page (132 B a state) beside its latent,
    and its 16-token tail ring (2 x 128 bf16) sits in a group that is never hashed."""
    plan = plan_for(Case(GLM5NEXT))
    # SM90 lists FlashInfer's sparse MLA first for a 512-wide latent (platforms/cuda.py)
    assert plan.gpu.attention_backend == "FLASHINFER_MLA_SPARSE_SM90"
    assert plan.block_size == 4608 and plan.mamba_cache_mode == "align"
    *kda, mla, ring = plan.kv_groups
    assert [g.kind for g in kda] == ["mamba"] * 4
    assert sum(g.num_layers for g in kda) == 34
    assert mla.kind == "mla" and mla.layer_page_bytes == [4608 // 16 * 132, 4608 * 1024] * 11
    assert (ring.kind, ring.tokens_per_block, ring.num_layers) == ("circular_buffer", 16, 11)
    assert ring.page_bytes == 11 * 16 * 2 * 128 * 2 and not ring.prefix_cacheable
    assert plan.tokens_per_hash == 4608  # the ring's 16 tokens do not set the hash unit
    assert [g.group_index for g in plan.upstream.groups] == [0, 1, 2, 3, 4]
    assert [g.group_index for g in plan.spillway.groups] == [0, 1, 2, 3, 4]


def test_spillway_pool_is_planned_as_its_connector_builds_it(
    layouts: FrontierLayouts, monkeypatch: pytest.MonkeyPatch
):
    """Spillway's connector sizes its pool from vLLM's offloaded groups (the ring is not
    one); the plan's units and chunk bytes are the connector's."""
    from spillway_engine.offloader import geometry as geometry_module
    from spillway_engine.offloader.geometry import build_geometry, with_extra_config

    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    case = Case(GLM5NEXT, 4)
    plan = plan_for(case)
    spillway = make_plan(
        load_frontier(GLM5NEXT),
        PlanRequest(
            tensor_parallel_size=4, gpu="h100", max_model_len=case.max_model_len,
            cpu_memory_bytes=POOL, offloader="spillway",
        ),
    )
    _cpu_workspace()
    built = vllm_for(layouts, case, plan)
    vc = with_extra_config(built.vllm_config, dict(spillway.kv_connector_extra_config))
    workers = build_geometry(vc, built.kv_cache_config).layout
    assert (spillway.spillway.unit_bytes, spillway.spillway.num_units) == (
        workers.unit_bytes,
        workers.num_units,
    )
    assert [g.group_index for g in spillway.spillway.groups] == [
        g.group_id for g in workers.groups
    ]
    # the plan counts every rank's bytes, the connector one worker's
    assert spillway.spillway.copies == workers.copies == 4
    assert [g.chunk_bytes for g in spillway.spillway.groups] == [
        g.chunk_bytes * workers.copies for g in workers.groups
    ]


def test_flashkda_checkpoints_leave_the_block_alone():
    """Where FlashKDA runs (Hopper, bf16, head 128, bounded gate) vLLM's KDA spec asks
    for prefill checkpoints every 16 tokens, but the layer keeps MambaBase's
    get_prefill_checkpoint_alignment (None), so _align_hybrid_block_size does not align
    the block to them; the block stays a multiple of 512 (the indexer's 32 entries)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    from vllm.models.glm5next.common.kda import Glm5NextLinearAttention
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes

    assert kda_prefill_checkpoint_alignment("flashkda") == 16
    assert kda_prefill_checkpoint_alignment("triton") is None
    assert (
        Glm5NextLinearAttention.get_prefill_checkpoint_alignment
        is MambaBase.get_prefill_checkpoint_alignment
    )
    assert min(get_paged_mqa_page_sizes()) * 16 == 512
    plan = plan_for(Case(GLM5NEXT, 2))
    assert any("prefill checkpoints every 16 tokens" in n for n in plan.notes)
    assert plan.block_size % 512 == 0


def test_fp8_latents_run_on_flashinfer_sm90_as_vllm_selects():
    """A NoPE 512 latent with plain fp8 on SM90: vLLM puts FLASHINFER_MLA_SPARSE_SM90
    first among the sparse backends at head 512, and the two behind it refuse the dtype
    (FlashAttention's sparse MLA is 16-bit only, FlashMLA's names its own reason), so
    the fp8 latents are FlashInfer's plain 512 B rows whichever backend is asked first.
    The plan names that backend, and its TP 1 block is 8,704 tokens (4,608 with bf16)."""
    import importlib.util
    from pathlib import Path

    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.flashattn_mla_sparse import FlashAttnMLASparseBackend
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Backend,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    # platforms/cuda.py needs libcuda to import: its SM90 order is read as text
    spec = importlib.util.find_spec("vllm.platforms")
    assert spec is not None and spec.origin is not None
    cuda = (Path(spec.origin).parent / "cuda.py").read_text()
    assert " ".join(cuda.split()).count(
        "flashinfer_sparse = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM90 "
        "if head_size == 512: sparse_tail.insert(0, flashinfer_sparse)"
    ) == 1
    sm90 = DeviceCapability(9, 0)
    assert FlashInferMLASparseSM90Backend.supports_compute_capability(sm90)
    assert {"fp8", "fp8_e4m3"} <= set(FlashInferMLASparseSM90Backend.supported_kv_cache_dtypes)
    for dtype in ("fp8", "fp8_e4m3"):
        assert dtype not in FlashAttnMLASparseBackend.supported_kv_cache_dtypes
        reason = FlashMLASparseBackend.supports_combination(
            head_size=512, dtype=torch.bfloat16, kv_cache_dtype=dtype, block_size=None,
            use_mla=True, has_sink=False, use_sparse=True, use_mm_prefix=False,
            device_capability=sm90,
        )
        assert reason and "supports head_size 512 only with bf16 or fp8_ds_mla" in reason
    plan = plan_for(Case(GLM5NEXT, 1, kv_cache_dtype="fp8"))
    assert plan.gpu.attention_backend == "FLASHINFER_MLA_SPARSE_SM90"
    assert plan.block_size == 8704
    *_, mla, _ring = plan.kv_groups
    assert mla.layer_page_bytes == [8704 // 16 * 132, 8704 * 512] * 11
    assert any("FlashInfer's kernels" in n for n in plan.notes)


@pytest.mark.parametrize("gpu", ["a100", "l40s"])
def test_off_hopper_is_refused_as_vllm_refuses(gpu: str):
    """Sparse MLA needs SM90 here: no backend in vLLM's SM8x list takes it."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    assert not FlashMLASparseBackend.supports_compute_capability(DeviceCapability(8, 0))
    with pytest.raises(PlanRefused, match="No valid attention backend found"):
        plan_for(Case(GLM5NEXT, 2, gpu=gpu))


def test_a_checkpoint_dropping_the_tail_is_refused_by_both():
    config = dict(load_frontier(GLM5NEXT), index_kpool_always_select_tail=False)
    reason = "requires index_kpool_always_select_tail=True"
    with pytest.raises(NotImplementedError, match=reason):
        build_layout(config, Case(GLM5NEXT, 8), "FLASH_ATTN_MLA_SPARSE")
    with pytest.raises(PlanRefused, match=reason):
        make_plan(config, PlanRequest(tensor_parallel_size=8, cpu_memory_bytes=POOL))


def test_mtp_on_the_text_model_is_refused_by_both():
    """vLLM's SpeculativeConfig turns only a ``glm5_next`` config into its MTP drafter
    (Glm5NextMTPModel); the text model's ``glm5_next_text`` stops it."""
    case = Case(GLM5NEXT, 2, speculative_method="mtp", num_speculative_tokens=1)
    reason = "Unsupported speculative method: 'mtp'"
    with pytest.raises(NotImplementedError, match=reason):
        build_layout(load_frontier(GLM5NEXT), case, "FLASH_ATTN_MLA_SPARSE")
    with pytest.raises(PlanRefused, match=reason):
        plan_for(case)


def test_a_separate_drafter_is_refused_as_not_modelled():
    """Not a vLLM refusal: a draft model or EAGLE-3 head beside the packed KDA and ring
    groups is not modelled, and the planner says so (GLM-5 Next's own MTP layers are)."""
    with pytest.raises(PlanRefused, match="with Glm5NextForCausalLM and a separate drafter"):
        plan_for(Case(GLM5NEXT, 2, speculative_method="draft_model", num_speculative_tokens=2))


#: GLM-5 Next's MTP drafter needs model_type glm5_next (SpeculativeConfig turns it into
#: glm5_next_mtp / Glm5NextMTPModel); the fixture's fields are otherwise unchanged
MTP_CASES = [
    Case(GLM5NEXT, 1, speculative_method="mtp", num_speculative_tokens=1),
    Case(GLM5NEXT, 2, speculative_method="mtp", num_speculative_tokens=2),
    Case(GLM5NEXT, 4, speculative_method="mtp", num_speculative_tokens=3),
    Case(GLM5NEXT, 8, speculative_method="mtp", num_speculative_tokens=1),
    Case(GLM5NEXT, 8, gpu="h200", speculative_method="mtp", num_speculative_tokens=3),
    Case(GLM5NEXT, 2, kv_cache_dtype="fp8", speculative_method="mtp", num_speculative_tokens=2),
]
_mtp_built: dict[Case, Any] = {}


def _mtp_config() -> dict[str, Any]:
    return dict(load_frontier(GLM5NEXT), model_type="glm5_next")


def _mtp_plan(case: Case, **kw: Any) -> Any:
    return make_plan(
        _mtp_config(),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size, gpu=case.gpu,
            kv_cache_dtype=case.kv_cache_dtype, max_model_len=case.max_model_len,
            speculative_method=case.speculative_method,
            num_speculative_tokens=case.num_speculative_tokens,
            cpu_memory_bytes=POOL, offloader="upstream", **kw,
        ),
    )


@pytest.mark.parametrize("case", MTP_CASES, ids=str)
def test_glm5next_mtp_groups_and_offload_match_vllm(case: Case):
    """vLLM's own Glm5NextMTPModel joins the forward context after the target: each MTP
    layer adds its indexer keys, tail ring and latent (layer 45 of 45); the ring grows to
    two pools (32 tokens) for 1-3 draft tokens and the KDA convolution states keep one
    more row per draft token, so the hybrid block and the packed split move with them."""
    plan = _mtp_plan(case)
    if case not in _mtp_built:
        _cpu_workspace()
        _mtp_built[case] = build_layout(_mtp_config(), case, plan.gpu.attention_backend)
    built = _mtp_built[case]
    assert built.vllm_config.speculative_config.method == "mtp"
    assert built.vllm_config.speculative_config.draft_model_config.architectures == [
        "Glm5NextMTPModel"
    ]
    assert _as_vllm(plan) == built.groups
    assert plan.block_size == built.block_size
    assert plan.model.num_cache_layers == len(built.layer_names)
    drafted = [built.layer_names[i] for i in plan.draft_layer_indices]
    assert drafted == [
        "model.layers.45.self_attn.indexer.k_cache",
        "model.layers.45.self_attn.indexer.tail_cache",
        "model.layers.45.self_attn.attn",
    ]
    assert plan.kv_groups[-1].tokens_per_block == 32  # the ring: 16 + draft tokens, 2 pools
    for bpc in BLOCKS_PER_CHUNK:
        planned = _mtp_plan(case, blocks_per_chunk=bpc)
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


def test_mtp_regroups_the_packed_blocks():
    """TP 2 (2,560-token blocks either way): without a drafter 34 KDA states pack in 4
    groups (9/9/8/8) beside 11 MLA layers; the MTP layer's 12th latent raises the anchor
    group, so vLLM packs them 12/11/11, and the ring holds two 16-token pools (the draft
    tokens need more than one), 12 rings of 32 tokens."""
    plain = plan_for(Case(GLM5NEXT, 2))
    mtp = _mtp_plan(MTP_CASES[1])
    assert plain.block_size == mtp.block_size == 2560
    assert [g.num_layers for g in plain.kv_groups] == [9, 9, 8, 8, 22, 11]
    assert [g.num_layers for g in mtp.kv_groups] == [12, 11, 11, 24, 12]
    ring = mtp.kv_groups[-1]
    assert (ring.tokens_per_block, ring.page_bytes) == (32, 12 * 32 * 2 * 128 * 2)
    assert mtp.worker_bytes_per_block > plain.worker_bytes_per_block
    assert any("MTP drafter: 3 cache layer(s)" in n for n in mtp.notes)


def test_without_prefix_caching_both_offloaders_refuse_the_hash_unit(layouts: FrontierLayouts):
    """Without prefix caching the KDA states keep max_model_len-token blocks: the hash
    unit is the lcm of every block (the ring's 16 tokens too, 40,960 at TP 2), which the
    KDA blocks do not divide, and vLLM's offloader asserts at start-up."""
    case = Case(GLM5NEXT, 2, enable_prefix_caching=False)
    _cpu_workspace()
    built = layouts.get(case, "FLASH_ATTN_MLA_SPARSE")
    assert not isinstance(built, Exception)
    assert [g["tokens_per_block"] for g in built.groups] == [8192] * 4 + [2560, 16]
    with pytest.raises(AssertionError, match="not divisible by tokens_per_hash=40960"):
        built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": 1})
    with pytest.raises(PlanRefused, match="8192 tokens per block, not a multiple of the 40960"):
        plan_for(case)


def test_engine_plan_check_passes_an_mtp_plan():
    """The engine's start-up check reads vLLM's groups with the MTP layers (3 KDA groups,
    the 24-page MLA group, 32-token rings) as the plan has them."""
    from spillway_engine.launcher import plan_check

    case = MTP_CASES[1]
    plan = _mtp_plan(case)
    _cpu_workspace()
    built = _mtp_built.get(case) or build_layout(_mtp_config(), case, plan.gpu.attention_backend)
    built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    observed = plan_check.observe(built.vllm_config, built.kv_cache_config)
    assert [g.kind for g in observed.groups] == (
        ["uniform(mamba)"] * 3 + ["uniform(mla)", "uniform(circular_buffer)"]
    )
    assert plan_check.compare(plan, observed) == []
