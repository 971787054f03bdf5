"""Sparse MLA's backend, cache format and block per GPU (``planner/sparse_mla.py``); the
contract tier compares each with vLLM 0.33.0 (``test_planner_blackwell_sparse.py``)."""

import pytest

from spillway_engine.planner.families import model_shape
from spillway_engine.planner.gpus import get_gpu
from spillway_engine.planner.kv_layout import LayoutRequest, compute_layout
from spillway_engine.planner.shape import UnsupportedModel
from tests.unit.planner_fixtures import load_frontier, load_model

DSV32, GLM5, GLM5NEXT = "deepseek-v3.2-exp", "glm-5", "glm-5.3-flash"


def layout(model, gpu, tp=1, **kw):
    kw.setdefault("max_model_len", 4096)
    return compute_layout(model_shape(load_frontier(model)), get_gpu(gpu),
                          LayoutRequest(tensor_parallel_size=tp, **kw))


@pytest.mark.parametrize(("model", "gpu", "tp", "dtype", "backend", "stored", "row"), [
    (DSV32, "b200", 1, "auto", "FLASHMLA_SPARSE", "bfloat16", 1152),  # 128 heads a rank
    (DSV32, "b200", 8, "auto", "FLASH_ATTN_MLA_SPARSE_FA4", "bfloat16", 1152),  # 16
    (DSV32, "b300", 8, "fp8", "FLASHINFER_MLA_SPARSE", "fp8", 576),
    (DSV32, "b200", 8, "fp8_ds_mla", "FLASHMLA_SPARSE", "fp8_ds_mla", 656),
    (DSV32, "h100", 8, "fp8", "FLASHMLA_SPARSE", "fp8_ds_mla", 656),
    (DSV32, "rtx-pro-6000", 1, "auto", "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla", 656),
    (GLM5, "b200", 8, "auto", "FLASHINFER_MLA_SPARSE", "fp8_e4m3", 576),  # the hook
    (GLM5, "gb300", 8, "bfloat16", "FLASH_ATTN_MLA_SPARSE_FA4", "bfloat16", 1152),
])
def test_dsa_latents_per_gpu(model, gpu, tp, dtype, backend, stored, row):
    out = layout(model, gpu, tp, kv_cache_dtype=dtype)
    assert (out.attention_backend, out.kv_cache_dtype, out.block_size) == (backend, stored, 64)
    (group,) = out.groups
    assert group.layer_page_bytes[:2] == (132 * 64, row * 64)


def test_glm5next_on_blackwell_takes_the_hooked_fp8_and_sm120_pages():
    b200 = layout(GLM5NEXT, "b200", 8)
    assert (b200.attention_backend, b200.kv_cache_dtype) == ("FLASHINFER_MLA_SPARSE", "fp8")
    hopper = layout(GLM5NEXT, "h100", 8)
    assert (hopper.attention_backend, hopper.kv_cache_dtype) == (
        "FLASHINFER_MLA_SPARSE_SM90", "bfloat16")
    rtx = layout(GLM5NEXT, "rtx-pro-6000", 8)
    # the indexer's 1024-entry pages on SM120, aligned with 512-byte nominal latents
    assert (rtx.attention_backend, rtx.kv_cache_dtype, rtx.block_size) == (
        "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla", 2048)


@pytest.mark.parametrize(("model", "gpu", "dtype", "why"), [
    (GLM5NEXT, "b200", "fp8_ds_mla", "FLASHMLA_SPARSE: head_size 512"),
    (GLM5, "rtx-pro-6000", "bfloat16", "FLASHINFER_MLA_SPARSE_SM120: kv_cache_dtype"),
    (DSV32, "b200", "fp8_e5m2", "FLASHINFER_MLA_SPARSE: kv_cache_dtype not supported"),
    (DSV32, "l40s", "auto", "need compute capability 9.x"),
])
def test_refused_as_vllm_finds_no_backend(model, gpu, dtype, why):
    with pytest.raises(UnsupportedModel, match="No valid attention backend found") as info:
        layout(model, gpu, 8, kv_cache_dtype=dtype)
    assert why in str(info.value)


def test_a_forced_block_must_hold_whole_indexer_pages():
    assert layout(DSV32, "b200", 8, kv_cache_dtype="fp8", block_size=128).block_size == 128
    with pytest.raises(UnsupportedModel, match="64-token pages"):
        layout(DSV32, "b200", 8, kv_cache_dtype="fp8", block_size=32)


def test_the_attention_free_fixture_is_one_mamba_group_on_16_token_blocks():
    out = compute_layout(model_shape(load_model("granite-4.0-h-small")), get_gpu("b200"),
                         LayoutRequest(max_model_len=2048))
    assert out.attention_backend is None and out.block_size == 16
    (group,) = out.groups
    assert (group.kind, group.tokens_per_block, len(group.layer_indices)) == ("mamba", 16, 40)
