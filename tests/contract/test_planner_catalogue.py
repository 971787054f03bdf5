"""Issue 43's acceptance: ``spillway plan --gpu <g>`` on every fixture model for every
catalogue GPU plans, or refuses exactly where vLLM 0.33.0 refuses.

vLLM's side is ``test_planner_kv_dtypes.vllm_side``: the model built as ``vllm serve``
builds it with the cache dtype, and every selector config its layers ask with given to
vLLM's CUDA selection on each GPU's capability. A plan must name the backend vLLM
picks; a refusal must be vLLM's (its config check, or no backend found). The geometry of
each plan is compared with vLLM's elsewhere (``test_planner_gpus``, ``_kv_dtypes``,
``_frontier``, ``_blackwell_sparse``); here every pair is planned, through the CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from spillway_cli.main import main
from spillway_engine.planner.gpus import GPUS

from .conftest import load_model
from .test_planner_kv_dtypes import _check_one, vllm_side
from .vllm_harness import Case

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "fixtures" / "models"
ALL_FIXTURES = sorted(p.stem for p in MODELS.glob("*.json"))
LEN = 2048  # inside every fixture's context (granite-4.0-h-small's default is 2048)
#: the fixture transformers reads as attention-free (its config names no layer_types)
ATTENTION_FREE = "granite-4.0-h-small"


def cli_plan(model: str, gpu: str, kv_cache_dtype: str) -> str | None:
    """``spillway plan --gpu`` as a user runs it (in this process): the backend, or
    ``refused: <reason>`` (None: no attention layer, no backend)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", "--model-config", str(MODELS / f"{model}.json"), "--gpu", gpu,
                   "--kv-cache-dtype", kv_cache_dtype, "--max-model-len", str(LEN),
                   "--cpu-memory", "64Gi", "--format", "json"])
    if rc == 2:
        return f"refused: {err.getvalue().strip()}"
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())["gpu"]["attention_backend"]


def test_every_fixture_is_in_the_loop():
    assert len(ALL_FIXTURES) >= 19 and ATTENTION_FREE in ALL_FIXTURES


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("model", ALL_FIXTURES)
def test_every_catalogue_gpu_plans_or_refuses_as_vllm(model: str, kv_cache_dtype: str):
    vllm = vllm_side(Case(model, kv_cache_dtype=kv_cache_dtype, max_model_len=LEN))
    failures = []
    for gpu in sorted(GPUS):
        planned = cli_plan(model, gpu, kv_cache_dtype)
        selected = vllm if isinstance(vllm, str) else vllm[gpu]
        if model == ATTENTION_FREE:
            # no layer asks vLLM's selector: every layer is a Mamba layer, planned so
            assert selected == (), f"{gpu}: vLLM selects {selected}"
            assert planned is None, f"{gpu}: {planned}"
            continue
        try:
            _check_one(gpu, planned, selected)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_the_attention_free_fixture_is_all_mamba_in_vllm():
    """transformers' GraniteMoeHybridConfig (5.20) fills a missing ``layer_types`` with
    ``linear_attention`` for every layer, and vLLM's granitemoehybrid.py builds a Mamba
    decoder layer for each: the fixture has no attention layer in vLLM either."""
    from transformers.models.granitemoehybrid import GraniteMoeHybridConfig

    config = load_model(ATTENTION_FREE)
    assert "layer_types" not in config
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf = GraniteMoeHybridConfig(**fields)
    assert hf.layer_types == ["linear_attention"] * config["num_hidden_layers"]


@pytest.mark.parametrize("case", [
    Case(ATTENTION_FREE, gpu="h100", max_model_len=LEN),
    Case(ATTENTION_FREE, 4, gpu="b200", max_model_len=LEN),
    Case(ATTENTION_FREE, 2, gpu="rtx-pro-6000", kv_cache_dtype="fp8", max_model_len=LEN),
    Case(ATTENTION_FREE, 8, gpu="a100", kv_cache_dtype="fp8", max_model_len=LEN),
], ids=str)
def test_the_attention_free_fixture_plans_as_vllm_builds_it(case: Case):
    """vLLM builds the 40 Mamba layers into one group on the default 16-token block (no
    attention backend to align to), each block a whole state; so does the plan."""
    from .test_planner_contract import POOL, plan_for, planned_groups
    from .vllm_harness import build_layout

    plan = plan_for(case)
    built = build_layout(load_model(ATTENTION_FREE), case, None)
    assert plan.gpu.attention_backend is None and built.cuda_selected == ()
    assert planned_groups(plan) == built.groups
    assert plan.block_size == built.block_size
    off = built.offload({"cpu_bytes_to_use": POOL,
                         "blocks_per_chunk": plan.blocks_per_chunk})
    assert plan.tokens_per_hash == off["tokens_per_hash"]
    assert plan.worker_bytes_per_block == off["worker_bytes_per_block"]
    up = plan.upstream
    assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
