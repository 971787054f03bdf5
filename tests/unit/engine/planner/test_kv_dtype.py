"""KV-cache dtypes a GPU cannot run: refused as vLLM 0.33.0 refuses them, with its reason
and the field to change (the contract tier checks every case against vLLM's selection)."""

import pytest

from spillway_engine.planner.attention_backend import KV_DTYPE_FIELD, VLLM_KV_CACHE_DTYPES
from spillway_engine.planner.families import model_shape
from spillway_engine.planner.gpus import GPUS, get_gpu
from spillway_engine.planner.kv_layout import LayoutRequest, compute_layout
from spillway_engine.planner.shape import KV_CACHE_DTYPES, UnsupportedModel
from tests.unit.planner_fixtures import load_model


def layout(model, gpu="h100", **kw):
    kw.setdefault("max_model_len", 4096)
    return compute_layout(model_shape(load_model(model)), get_gpu(gpu), LayoutRequest(**kw))


def refusal(model, gpu, kv_cache_dtype) -> str:
    with pytest.raises(UnsupportedModel) as info:
        layout(model, gpu, kv_cache_dtype=kv_cache_dtype)
    return str(info.value)


def test_every_modelled_dtype_is_one_vllm_accepts():
    assert set(KV_CACHE_DTYPES) <= set(VLLM_KV_CACHE_DTYPES)


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_float16_cache_for_a_bfloat16_model_is_refused_with_vllms_words(gpu):
    # VllmConfig._reject_mismatched_float_kv_cache: the planner used to plan it
    text = refusal("llama-3.2-1b", gpu, "float16")
    assert text.startswith(KV_DTYPE_FIELD)
    assert ('kv_cache_dtype="float16" is incompatible with dtype="bfloat16". Please set '
            "`--kv-cache-dtype` to `auto` or `bfloat16`.") in text
    assert layout("llama-3.2-1b", gpu, kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("gpu", ["h100", "a100", "b200", "rtx-pro-6000"])
@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_inc", "fp8_per_token_head", "turboquant_k8v4"])
def test_mla_backends_store_no_such_cache(gpu, dtype):
    text = refusal("deepseek-v2-lite", gpu, dtype)
    assert text.startswith(KV_DTYPE_FIELD)
    assert "No valid attention backend found" in text
    assert "TRITON_MLA" in text and "kv_cache_dtype not supported" in text


@pytest.mark.parametrize("dtype", ["fp8_inc", "fp8_ds_mla", "octave_k3v4", "ultraquant_4bit"])
def test_attention_backends_store_no_such_cache(dtype):
    text = refusal("llama-3.2-1b", "b200", dtype)
    assert f"refuses {dtype!r}" in text
    assert "No valid attention backend found: FLASHINFER, FLASH_ATTN, TRITON_ATTN" in text


def test_nvfp4_with_mla_is_refused_before_any_backend():
    assert "not supported with MLA" in refusal("deepseek-v3", "b200", "nvfp4")


@pytest.mark.parametrize(("gpu", "dtype", "takers"), [
    ("h100", "fp8_per_token_head", "TRITON_ATTN"),
    ("a100", "int8_per_token_head", "TRITON_ATTN"),
    ("b200", "nvfp4_4over6", "FLASHINFER"),  # SM10x's TRT-LLM kernels only
    ("h100", "turboquant_k8v4", "TURBOQUANT"),
])
def test_a_cache_vllm_stores_but_the_planner_does_not_model_says_so(gpu, dtype, takers):
    text = refusal("llama-3.2-1b", gpu, dtype)
    assert text.startswith(f"{KV_DTYPE_FIELD} {dtype!r} is not modelled")
    assert f"stores it only with {takers}," in text


def test_nvfp4_4over6_off_blackwell_has_no_backend():
    assert "No valid attention backend found" in refusal("llama-3.2-1b", "h100", "nvfp4_4over6")


def test_an_unknown_dtype_lists_vllms():
    text = refusal("llama-3.2-1b", "h100", "fp4")
    assert "Invalid kv_cache_dtype: 'fp4'" in text and "fp8_e5m2" in text


@pytest.mark.parametrize(("model", "gpu", "backend"), [
    ("llama-3.2-1b", "h100", "FLASHINFER"),  # FA3 stores no e5m2: FlashInfer, next
    ("llama-3.2-1b", "b200", "FLASHINFER"),
    ("llama-3.2-1b", "a100", "FLASHINFER"),
    ("gpt-oss-120b", "a100", "TRITON_ATTN"),  # sinks on SM8x
    ("gemma-3-27b-it", "h100", "TRITON_ATTN"),  # prefix-LM: the FA composite has no e5m2
    ("gemma-3-12b-it", "b200", "TRITON_FLASHINFER"),
])
def test_fp8_e5m2_runs_where_vllm_stores_it(model, gpu, backend):
    lay = layout(model, gpu, kv_cache_dtype="fp8_e5m2")
    assert (lay.attention_backend, lay.kv_cache_dtype) == (backend, "fp8_e5m2")
    fp8 = layout(model, gpu, kv_cache_dtype="fp8")
    assert [g.page_bytes for g in lay.groups] == [g.page_bytes for g in fp8.groups]
