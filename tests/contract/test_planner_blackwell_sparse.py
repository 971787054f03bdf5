"""Sparse MLA (DeepSeek-V3.2, GLM-5, GLM-5 Next) and Gemma 4 on Blackwell against
vLLM 0.33.0.

For each case vLLM's side is built in three steps, each vLLM's own code:

1. the architecture's config hook (``models/config.py`` ``MODELS_CONFIG_MAP``) runs with
   the platform reporting CUDA and the GPU's capability: GLM-5 turns ``auto`` into
   fp8_e4m3 on SM10x, GLM-5 Next into fp8;
2. the model is built with that cache dtype (``vllm_harness.build_layout``) and every
   selector config its layers ask with goes to vLLM's CUDA selection on the GPU's
   capability (``cuda_selector``, a process of its own): it must pick the plan's backend;
3. the layers, given that backend's class (FA4's sparse MLA needs CUDA to import: the
   FlashInfer TRT-LLM class it extends stands in with its 64-token pages), canonicalise
   the cache dtype, build their specs, and vLLM groups and sizes them and plans the
   offloader: groups, block size, pages, hash unit, rows and chunks must be the plan's.

On SM12x DeepGEMM's paged MQA takes only 64-entry pages (``get_paged_mqa_page_sizes``
asks the device family, which the CPU is not): GLM-5 Next's indexer backend is given
SM120's answer while it is built.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from spillway_engine.planner.gpus import get_gpu
from spillway_engine.planner.plan import PlanRefused

from .test_planner_frontier import (
    BLOCKS_PER_CHUNK,
    POOL,
    _cpu_workspace,
    load_frontier,
    plan_for,
    planned_groups_as_vllm,
)
from .vllm_harness import Case, build_layout

DSV32 = "deepseek-v3.2-exp"
GLM5 = "glm-5"
GLM5NEXT = "glm-5.3-flash"
GEMMA4 = "gemma-4-31b"
GEMMA4_E2B = "gemma-4-e2b"
#: the architectures whose config hooks touch the cache dtype
_HOOKED = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm5NextForCausalLM")
LEN = 4096

CASES = [
    Case(model, tp, gpu=gpu, kv_cache_dtype=dtype, max_model_len=LEN)
    for model in (DSV32, GLM5, GLM5NEXT)
    for gpu in ("b200", "rtx-pro-6000")
    for tp in (1, 8)
    for dtype in ("auto", "fp8", "fp8_ds_mla")
] + [
    # SM103 is SM10x to every rule here
    Case(DSV32, 8, gpu="b300", max_model_len=LEN),
    Case(GLM5, 8, gpu="gb300", max_model_len=LEN),
    # a 16-bit cache asked explicitly: no hook, FA4 (<= 16 heads) or FlashMLA
    Case(GLM5, 8, gpu="b200", kv_cache_dtype="bfloat16", max_model_len=LEN),
    Case(GLM5, 1, gpu="b200", kv_cache_dtype="bfloat16", max_model_len=LEN),
    Case(GLM5NEXT, 8, gpu="b200", kv_cache_dtype="bfloat16", max_model_len=LEN),
    # fp8_ds_mla asked on Hopper: FlashMLA's sparse kernel (the NoPE 512 latent too)
    Case(DSV32, 8, gpu="h100", kv_cache_dtype="fp8_ds_mla", max_model_len=LEN),
    Case(GLM5NEXT, 8, gpu="h100", kv_cache_dtype="fp8_ds_mla", max_model_len=LEN),
    # Gemma 4 on SM10x: FlashInfer takes both head sizes (256, 512), 16-token pages
    *(Case(GEMMA4, tp, gpu=gpu, kv_cache_dtype=dtype, max_model_len=LEN)
      for gpu in ("b200", "b300") for tp in (1, 8) for dtype in ("auto", "fp8")),
    Case(GEMMA4_E2B, gpu="b200", max_model_len=LEN),
]


@contextlib.contextmanager
def _as_on(gpu: str) -> Iterator[None]:
    """``current_platform`` reports CUDA on ``gpu``'s capability (the config hooks ask it)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    platform = type(current_platform)
    cap = DeviceCapability(*get_gpu(gpu).compute_capability)
    saved = {n: platform.__dict__.get(n) for n in ("get_device_capability", "is_cuda")}
    platform.get_device_capability = classmethod(lambda cls, device_id=0: cap)  # type: ignore
    platform.is_cuda = lambda self: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, real in saved.items():
            if real is None:
                delattr(platform, name)
            else:
                setattr(platform, name, real)


def vllm_hooked_dtype(case: Case) -> str:
    """The cache dtype after the architecture's own ``verify_and_update_config`` on the GPU."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    config = load_frontier(case.model)
    if config["architectures"][0] not in _HOOKED:
        return case.kv_cache_dtype
    hook = MODELS_CONFIG_MAP[config["architectures"][0]]
    text = types.SimpleNamespace(**config)
    vc = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(cache_dtype=case.kv_cache_dtype),
        speculative_config=None,
        parallel_config=types.SimpleNamespace(set_dcp_defaults=lambda **kw: None),
        model_config=types.SimpleNamespace(hf_config=text, hf_text_config=text),
    )
    with _as_on(case.gpu):
        hook.verify_and_update_config(vc)
    return vc.cache_config.cache_dtype


@contextlib.contextmanager
def _device_facts(gpu: str) -> Iterator[None]:
    """DeepGEMM's paged-MQA page sizes as the GPU's family has them, and FlashInfer's
    SM120 sparse decode present (the CUDA image ships flashinfer-cubin; the selector's
    process counts FlashInfer as usable the same way)."""
    from vllm.utils import flashinfer
    from vllm.v1.attention.backends.mla import indexer

    real = indexer.get_paged_mqa_page_sizes, flashinfer.has_flashinfer_sparse_mla_sm120
    if get_gpu(gpu).compute_capability[0] == 12:
        indexer.get_paged_mqa_page_sizes = lambda: (64,)  # type: ignore[assignment]
        flashinfer.has_flashinfer_sparse_mla_sm120 = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        indexer.get_paged_mqa_page_sizes, flashinfer.has_flashinfer_sparse_mla_sm120 = real


_built: dict[Case, Any] = {}


def vllm_built(case: Case, backend: str) -> Any:
    if case not in _built:
        hooked = replace(case, kv_cache_dtype=vllm_hooked_dtype(case))
        _cpu_workspace()
        try:
            with _device_facts(case.gpu):
                _built[case] = build_layout(load_frontier(case.model), hooked, backend)
        except Exception as refusal:  # vLLM refusing is a result too
            _built[case] = refusal
    return _built[case]


def _as_vllm(plan: Any) -> list[dict[str, Any]]:
    groups = planned_groups_as_vllm(plan)
    for described in groups:
        if described["kind"] == "uniform:circular_buffer":
            described["kind"] = "uniform:CircularBufferSpec"
    return groups


def _vllm_selection(case: Case) -> tuple[str, ...]:
    """vLLM's CUDA selection for the model built with the hooked dtype (the latents
    constructed on FlashMLA's sparse class: a dense MLA class takes no top-k buffer)."""
    built = vllm_built(case, "FLASHMLA_SPARSE")
    if isinstance(built, Exception):
        raise built
    return built.cuda_selected


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_matches_vllm_on_blackwell(case: Case):
    try:
        plan = plan_for(case)
    except PlanRefused as refusal:
        # the planner refuses: vLLM's selection finds no backend either
        selected = _vllm_selection(case)
        assert selected and all(s.startswith("refused") for s in selected), (
            f"planner refuses ({refusal}); vLLM selects {selected}")
        assert "No valid attention backend found" in str(refusal)
        return
    backend = plan.gpu.attention_backend
    built = vllm_built(case, backend)
    if isinstance(built, Exception):
        pytest.fail(f"vLLM refused {case} which the planner accepts: {built!r}")
    assert backend in built.cuda_selected, (
        f"vLLM's CUDA selection on {case.gpu}: {built.cuda_selected}, plan: {backend}")
    assert not [s for s in built.cuda_selected if s.startswith("refused")]
    cache = built.vllm_config.cache_config.cache_dtype
    model_dtype = str(built.vllm_config.model_config.dtype).removeprefix("torch.")
    assert plan.kv_cache_dtype == (model_dtype if cache == "auto" else cache)
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
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
        assert up.gauge_tokens == off["gauge_tokens"]
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]


def test_the_hooks_switch_the_cache_on_sm10x_only():
    """vLLM's own hooks: GLM-5's auto is fp8_e4m3 on SM10x, GLM-5 Next's fp8, none on
    SM12x or SM90; the plans report what vLLM then runs."""
    assert vllm_hooked_dtype(Case(GLM5, gpu="b200")) == "fp8_e4m3"
    assert vllm_hooked_dtype(Case(GLM5NEXT, gpu="b300")) == "fp8"
    assert vllm_hooked_dtype(Case(GLM5, gpu="rtx-pro-6000")) == "auto"
    assert vllm_hooked_dtype(Case(GLM5, gpu="h100")) == "auto"
    assert plan_for(Case(GLM5, 8, gpu="b200")).kv_cache_dtype == "fp8_e4m3"
    assert plan_for(Case(GLM5NEXT, 8, gpu="b200")).kv_cache_dtype == "fp8"
    assert plan_for(Case(GLM5, 8, gpu="h100")).kv_cache_dtype == "bfloat16"


def test_sparse_backend_follows_the_heads_a_rank_on_sm10x():
    """16-bit DeepSeek-V3.2 on B200: 128 heads at TP 1 go to FlashMLA's sparse kernel,
    16 heads a rank at TP 8 to FA4's; fp8 goes to FlashInfer's TRT-LLM kernel (plain
    576 B rows, 32-row pages); RTX PRO 6000 stores fp8_ds_mla even for auto."""
    assert plan_for(Case(DSV32, 1, gpu="b200")).gpu.attention_backend == "FLASHMLA_SPARSE"
    assert plan_for(Case(DSV32, 8, gpu="b200")).gpu.attention_backend == (
        "FLASH_ATTN_MLA_SPARSE_FA4")
    fp8 = plan_for(Case(DSV32, 8, gpu="b200", kv_cache_dtype="fp8"))
    assert (fp8.gpu.attention_backend, fp8.kv_cache_dtype, fp8.block_size) == (
        "FLASHINFER_MLA_SPARSE", "fp8", 64)
    assert fp8.kv_groups[0].layer_page_bytes[:2] == [132 * 64, 576 * 64]
    rtx = plan_for(Case(DSV32, 8, gpu="rtx-pro-6000"))
    assert (rtx.gpu.attention_backend, rtx.kv_cache_dtype) == (
        "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla")
    assert rtx.kv_groups[0].layer_page_bytes[:2] == [132 * 64, 656 * 64]


DSV4 = "deepseek-v4-flash"


@pytest.mark.parametrize(("gpu", "backend"), [
    ("h100", "FLASHMLA_SPARSE_DSV4"),
    ("b200", "FLASHMLA_SPARSE_DSV4"),
    ("gb300", "FLASHMLA_SPARSE_DSV4"),
    ("rtx-pro-6000", "FLASHINFER_MLA_SPARSE_DSV4"),
])
def test_deepseek_v4_runs_the_v4_class_vllm_picks_on_the_same_pages(gpu: str, backend: str):
    """DeepSeek-V4's layers choose their own class (``_select_dsv4_attn_cls``, no
    --attention-backend): FlashMLA's V4 kernels except on SM12x, FlashInfer's there; both
    keep the fp8_ds_mla layout and 256-token kernel pages, so the plan is Hopper's with
    the backend named. (Its layout is compared with vLLM's in test_planner_deepseek_v4.)"""
    from vllm.models.deepseek_v4.nvidia import model

    vc = types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=None))
    with _as_on(gpu):
        cls = model._select_dsv4_attn_cls(vc)  # type: ignore[arg-type]
    assert cls.backend_cls.get_name() == backend
    assert cls.use_fp8_ds_mla_layout
    assert cls.backend_cls.get_supported_kernel_block_sizes() == [256]
    plan = plan_for(Case(DSV4, 8, gpu=gpu, max_model_len=LEN))
    hopper = plan_for(Case(DSV4, 8, gpu="h100", max_model_len=LEN))
    assert (plan.gpu.attention_backend, plan.kv_cache_dtype) == (backend, "fp8_ds_mla")
    assert _as_vllm(plan) == _as_vllm(hopper)
    assert plan.worker_bytes_per_block == hopper.worker_bytes_per_block
