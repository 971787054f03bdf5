"""The planner's backend choice per GPU equals vLLM 0.33.0's own CUDA selection.

For each case the model is built as vLLM builds it (``vllm_harness``); every selector
config its layers ask with is given to vLLM's CUDA selection (``platforms/cuda.py``) on
the planned GPU's compute capability, in a process of its own (``cuda_selector``). The
plan must name the backend vLLM picks, and vLLM's planning with that backend's kernel
block sizes must give the plan's groups, block size, hash unit and offload rows.
"""

from __future__ import annotations

import pytest

from .test_planner_contract import POOL, plan_for, planned_groups, vllm_for
from .vllm_harness import Case

#: every fixture with attention layers (granite-4.0-h-small's fixture names no layer_types, so
#: transformers makes every layer Mamba: test_planner_catalogue.py plans it)
FIXTURES = [
    "deepseek-v2-lite",
    "deepseek-v3",
    "gemma-2-9b",
    "gemma-3-12b-it",
    "gemma-3-1b-it",
    "gemma-3-27b-it",
    "gpt-oss-120b",
    "jamba-mini-1.5",
    "kimi-linear-48b-a3b",
    "llama-3.1-70b-instruct",
    "llama-3.2-1b",
    "llama-4-scout-17b-16e",
    "mistral-7b-v0.1",
    "nemotron-h-8b-base-8k",
    "phi-3-mini-4k-instruct",
    "qwen2.5-7b-instruct",
    "qwen3-30b-a3b",
    "qwen3-next-80b-a3b-instruct",
]
LEN = 4096  # inside every fixture's context

CASES = [
    # every family on Blackwell (SM100) and RTX PRO 6000 (SM120), 16-bit KV
    *(Case(m, gpu=g, max_model_len=LEN) for m in FIXTURES for g in ("b200", "rtx-pro-6000")),
    # FP8 KV: FlashInfer everywhere on SM10x, and where FA2 cannot on SM12x
    *(
        Case(m, gpu=g, kv_cache_dtype="fp8", max_model_len=LEN)
        for m in ("llama-3.2-1b", "gemma-3-12b-it", "gpt-oss-120b", "deepseek-v2-lite",
                  "jamba-mini-1.5", "qwen3-next-80b-a3b-instruct")
        for g in ("b200", "rtx-pro-6000")
    ),
    # fp8_e5m2: FlashAttention stores none, so FlashInfer or Triton on every GPU
    *(
        Case(m, gpu=g, kv_cache_dtype="fp8_e5m2", max_model_len=LEN)
        for m, g in (("llama-3.2-1b", "h100"), ("llama-3.2-1b", "a100"),
                     ("gpt-oss-120b", "a100"), ("gpt-oss-120b", "h100"),
                     ("gemma-3-27b-it", "h100"), ("gemma-3-12b-it", "b200"),
                     ("jamba-mini-1.5", "h100"), ("qwen3-next-80b-a3b-instruct", "h100"),
                     ("gemma-3-1b-it", "rtx-pro-6000"))
    ),
    # the rest of the catalogue: SM103, Grace Blackwell, H20, L4
    Case("llama-3.1-70b-instruct", 8, gpu="b300", max_model_len=LEN),
    Case("deepseek-v3", 8, gpu="gb200", max_model_len=LEN),
    Case("qwen3-next-80b-a3b-instruct", 4, gpu="gb300", max_model_len=LEN),
    Case("gemma-3-27b-it", 4, gpu="b200", max_model_len=LEN),
    Case("gpt-oss-120b", 4, gpu="h20", max_model_len=LEN),
    Case("gemma-3-1b-it", gpu="l4", max_model_len=LEN),
    # Hopper's prefix-LM rule by head size (Gemma 3 27B's 128-wide heads: Triton)
    Case("gemma-3-27b-it", gpu="h100", max_model_len=LEN),
    Case("gemma-3-12b-it", gpu="h100", max_model_len=LEN),
    # a CUDA 12 engine image: Triton's GDN prefill on Blackwell, no 64-token grid
    Case("qwen3-next-80b-a3b-instruct", gpu="b200", max_model_len=LEN, cuda_major=12),
    # a forced block FlashInfer-MLA does not run (16): Triton-MLA, as vLLM falls back
    Case("deepseek-v2-lite", gpu="b200", max_model_len=LEN, block_size=16),
    Case("deepseek-v2-lite", gpu="b200", max_model_len=LEN, block_size=64),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_backend_and_geometry_match_vllm_on_the_gpu(case: Case, vllm_layouts):
    plan = plan_for(case, cuda_major=case.cuda_major)
    built = vllm_for(vllm_layouts, case, plan)
    assert built.cuda_selected == (plan.gpu.attention_backend,), (
        f"vLLM's CUDA selection on {case.gpu}: {built.cuda_selected}, "
        f"plan: {plan.gpu.attention_backend}"
    )
    assert planned_groups(plan) == built.groups
    assert plan.block_size == built.block_size
    off = built.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    assert plan.tokens_per_hash == off["tokens_per_hash"]
    assert plan.worker_bytes_per_block == off["worker_bytes_per_block"]
    up = plan.upstream
    assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
    assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]


def test_blackwell_moves_mla_to_flashinfer_with_32_token_blocks():
    """The issue's figure: DeepSeek-style MLA on B200 runs FlashInfer-MLA's 32-token pages
    (twice Hopper's 16), with an FP8 cache too (Hopper: FlashMLA's 64)."""
    hopper = plan_for(Case("deepseek-v3", 8))
    b200 = plan_for(Case("deepseek-v3", 8, gpu="b200"))
    assert (hopper.gpu.attention_backend, hopper.block_size) == ("FLASH_ATTN_MLA", 16)
    assert (b200.gpu.attention_backend, b200.block_size) == ("FLASHINFER_MLA", 32)
    assert b200.kv_groups[0].page_bytes == 2 * hopper.kv_groups[0].page_bytes
    fp8 = plan_for(Case("deepseek-v3", 8, gpu="b200", kv_cache_dtype="fp8"))
    assert (fp8.gpu.attention_backend, fp8.block_size) == ("FLASHINFER_MLA", 32)


def test_qwen3_next_block_follows_the_cuda_runtime_on_blackwell():
    cu13 = plan_for(Case("qwen3-next-80b-a3b-instruct", gpu="b200"))
    cu12 = plan_for(Case("qwen3-next-80b-a3b-instruct", gpu="b200"), cuda_major=12)
    assert (cu13.gpu.gdn_prefill_kernel, cu13.block_size) == ("flashinfer", 576)
    assert (cu12.gpu.gdn_prefill_kernel, cu12.block_size) == ("triton", 544)
