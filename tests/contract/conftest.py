"""Contract tier: the planner against vLLM 0.33.0's own planning code, on the CPU.

This tier must fail, never skip, when vLLM 0.33.0 is missing: a skipped contract is
a contract nobody checks.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

from spillway_engine.vllm_pins import VLLM_VERSION as REQUIRED_VLLM

try:
    _found = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    _found = None
if _found != REQUIRED_VLLM:
    raise RuntimeError(
        f"tests/contract needs vllm=={REQUIRED_VLLM} importable (found: {_found or 'none'}); "
        "install it with `pip install -e '.[engine,test]'` (see tests/contract/README.md)"
    )

from .vllm_harness import Case, VllmLayout, build_layout

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/contract" in str(item.path):
            item.add_marker(pytest.mark.contract)


def load_model(name: str) -> dict[str, Any]:
    return json.loads((MODELS / f"{name}.json").read_text())["config"]


class LayoutCache:
    """vLLM layouts built once per case for the whole session (building is the cost)."""

    def __init__(self) -> None:
        self._built: dict[Case, VllmLayout | Exception] = {}

    def get(self, case: Case, attention_backend: str | None) -> VllmLayout | Exception:
        if case not in self._built:
            try:
                self._built[case] = build_layout(load_model(case.model), case, attention_backend)
            except Exception as e:  # vLLM refusing is a result too
                self._built[case] = e
        return self._built[case]


@pytest.fixture(scope="session")
def vllm_layouts() -> LayoutCache:
    return LayoutCache()
