"""Every --kv-cache-dtype vLLM 0.33.0 accepts, on every catalogue GPU, for every fixture
family: the planner plans with the backend vLLM's CUDA selection picks, or refuses.

vLLM's side (``vllm_harness.cuda_selections``): the model built as ``vllm serve`` builds
it with that cache dtype (its config checks run: a float16 cache for a bfloat16 model,
NVFP4 with MLA), and every selector config its layers ask with given to vLLM's CUDA
selection on the GPU's compute capability (``cuda_selector``, a process of its own).

* the planner plans: vLLM picks exactly the plan's backend;
* vLLM refuses: the planner refuses too, naming ``spec.engine.kvCacheDtype`` and vLLM's
  reason (its config message, or "No valid attention backend found" with each backend
  the planner names refused by vLLM for ``kv_cache_dtype not supported``);
* vLLM runs it but the planner does not model that cache format: the refusal says "not
  modelled" and names a backend vLLM picked among those that store it.
"""

from __future__ import annotations

import re

import pytest

from spillway_engine.planner.attention_backend import KV_DTYPE_FIELD, VLLM_KV_CACHE_DTYPES
from spillway_engine.planner.gpus import GPUS
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan

from .conftest import load_model
from .test_planner_gpus import FIXTURES
from .vllm_harness import Case, cuda_selections

LEN = 4096
_VALUE_ERROR = re.compile(r"Value error, (.*?) \[type=value_error", re.S)


def vllm_side(case: Case) -> dict[str, tuple[str, ...]] | str:
    """Per GPU, what vLLM selects; or the text of its refusal before selecting."""
    try:
        return cuda_selections(load_model(case.model), case, sorted(GPUS))
    except Exception as refusal:  # vLLM's config validation
        found = _VALUE_ERROR.search(str(refusal))
        return found.group(1) if found else f"{type(refusal).__name__}: {refusal}"


def planner_side(model: str, gpu: str, kv_cache_dtype: str) -> str:
    """The plan's backend, or ``refused: <reason>``."""
    try:
        plan = make_plan(load_model(model), PlanRequest(
            gpu=gpu, kv_cache_dtype=kv_cache_dtype, max_model_len=LEN,
            cpu_memory_bytes=64 * 2**30))
    except PlanRefused as refusal:
        return f"refused: {refusal}"
    return plan.gpu.attention_backend


def _check_one(gpu: str, planned: str, vllm: tuple[str, ...] | str) -> None:
    vllm_refused = isinstance(vllm, str) or any(n.startswith("refused") for n in vllm)
    if not planned.startswith("refused"):
        assert not vllm_refused, f"{gpu}: planned {planned}, vLLM refuses: {vllm}"
        assert vllm == (planned,), f"{gpu}: planned {planned}, vLLM picks {vllm}"
        return
    assert KV_DTYPE_FIELD in planned, f"{gpu}: {planned}"
    if isinstance(vllm, str) and vllm.startswith("NotImplementedError"):
        # vLLM stopped building the model before any selection (TurboQuant on a hybrid
        # with no full-attention layer): the planner's earlier-found reason stands
        assert "vLLM 0.33.0 refuses" in planned or "not modelled" in planned
    elif isinstance(vllm, str):  # refused by vLLM's config: its sentence, in the plan's
        assert vllm.split(". Please")[0] in planned, f"{gpu}: vLLM: {vllm}; plan: {planned}"
    elif vllm_refused:
        assert "not modelled" in planned or "No valid attention backend found" in planned
        if "No valid attention backend found" in planned:
            text = " ".join(n for n in vllm if n.startswith("refused"))
            named = planned.split("No valid attention backend found: ")[1].split(":")[0]
            for backend in named.split(", "):
                assert re.search(rf"\b{backend}: \[[^\]]*'kv_cache_dtype not supported'",
                                 text), f"{gpu}: vLLM did not refuse {backend}'s dtype: {text}"
    else:
        assert "is not modelled" in planned, f"{gpu}: vLLM picks {vllm}; plan: {planned}"
        takers = re.search(r"stores it only with (.*?), whose", planned)
        assert takers and set(vllm) & set(takers.group(1).split(", ")), (
            f"{gpu}: vLLM picks {vllm}; plan: {planned}")


@pytest.mark.parametrize("kv_cache_dtype", VLLM_KV_CACHE_DTYPES)
@pytest.mark.parametrize("model", FIXTURES)
def test_plan_or_refusal_matches_vllm_on_every_gpu(model: str, kv_cache_dtype: str):
    vllm = vllm_side(Case(model, kv_cache_dtype=kv_cache_dtype, max_model_len=LEN))
    failures = []
    for gpu in sorted(GPUS):
        planned = planner_side(model, gpu, kv_cache_dtype)
        try:
            _check_one(gpu, planned, vllm if isinstance(vllm, str) else vllm[gpu])
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_the_harness_sees_vllms_refusals():
    """The comparison is worth something only if vLLM's side can refuse: fp8_e5m2 with
    MLA on Hopper has no backend, and a float16 cache for a bfloat16 model fails its
    config check."""
    mla = vllm_side(Case("deepseek-v2-lite", kv_cache_dtype="fp8_e5m2", max_model_len=LEN))
    assert mla["h100"][0].startswith("refused: No valid attention backend found")
    assert "incompatible" in vllm_side(Case("llama-3.2-1b", kv_cache_dtype="float16",
                                             max_model_len=LEN))


@pytest.mark.parametrize(("arch", "gpu", "backend"), [
    ("LlamaForCausalLM", "h100", "FLASHINFER"),
    ("GptOssForCausalLM", "a100", "TRITON_ATTN"),
])
def test_an_fp8_e5m2_plan_starts_on_the_emulated_gpu(arch: str, gpu: str, backend: str,
                                                    tmp_path):
    """The engine starts vLLM with the plan's fp8_e5m2 cache on the backend vLLM falls to,
    and vLLM's KV config passes the plan check."""
    from e2e import engine_process as ep
    from spillway_engine.emulator.launch import default_emulated_kv_bytes
    from spillway_engine.emulator.tiny import write_model

    from .test_emulated_families import POOL_BYTES, tiny_config

    model_dir = write_model(tmp_path / "model", tiny_config(arch))
    plan = ep.plan_for(model_dir, cpu_memory_bytes=POOL_BYTES, gpu=gpu,
                       kv_cache_dtype="fp8_e5m2")
    assert (plan.gpu.attention_backend, plan.kv_cache_dtype) == (backend, "fp8_e5m2")
    plan_path = ep.write_plan(tmp_path / "run", plan, model_dir)
    log = tmp_path / "engine.log"
    proc = ep.launch(plan_path, log, port := ep.free_port(), default_emulated_kv_bytes(plan))
    server = ep.Server(arch, proc, port, log, plan, 0.0)
    try:
        ep.wait_ready(server)
        out = ep.post(server.url("/v1/completions"),
                      {"model": "tiny", "prompt": [5 + i % 400 for i in range(40)],
                       "max_tokens": 4})
        assert out["usage"]["completion_tokens"] == 4, out
        assert "Spillway plan check passed" in server.log_text()
    finally:
        ep.kill_group(proc)
