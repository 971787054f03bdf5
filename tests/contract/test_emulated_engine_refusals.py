"""Bad input at an emulated engine's start: each ends in a non-zero exit that names
the problem, within a bounded time (nothing hangs). The wrong-plan case is in
``test_emulated_engine.py``; a corrupted host page (serving, not start-up) too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.contract.test_emulated_engine import (
    EXIT_TIMEOUT_S,
    MODELS,
    _free_port,
    _kill_group,
    _launch,
    _plan,
    _write_plan,
)
from tests.contract.test_emulated_engine import models as models


def _exit_and_log(root: Path, plan_path: Path, kv_bytes: int) -> tuple[int, str]:
    proc = _launch(plan_path, root / "engine.log", _free_port(), kv_bytes)
    try:
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine kept running: {root / 'engine.log'}")
    finally:
        _kill_group(proc)
    return rc, (root / "engine.log").read_text(errors="replace")


def test_an_emulated_budget_too_small_for_one_request_stops_the_engine(models):
    """vLLM's own check: the KV cache cannot hold one max_model_len sequence."""
    model_dir = models["llama"]
    root = model_dir.parent / "tiny-budget"
    plan_path = _write_plan(root, _plan(model_dir), model_dir)
    rc, log = _exit_and_log(root, plan_path, 4 * 4096)  # 4 blocks: 64 of 1024 tokens
    assert rc != 0
    assert "larger than the available KV cache memory" in log or \
        "max_model_len" in log, log[-3000:]


def test_a_model_without_a_tokenizer_stops_the_engine(models, tmp_path):
    model_dir = models["llama"]
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    root = tmp_path / "run"
    plan_path = _write_plan(root, _plan(bare), bare)
    rc, log = _exit_and_log(root, plan_path, MODELS["llama"][1])
    assert rc != 0
    assert "tokenizer" in log.lower(), log[-3000:]
