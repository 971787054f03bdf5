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


#: The files that start emulated engines, longest first (one test at a time, 2 cores:
#: 13.4, 8.7, 6.0, 4.0, 3.0, 2.7, 2.0 minutes...). make test runs a file per xdist
#: worker; started first, they do not leave one worker alone with a long file at the end.
LONG_FIRST = ("test_emulated_families.py", "test_simulator_vs_engine.py",
              "test_disk_tier_engine.py", "test_planner_kv_dtypes.py",
              "test_emulated_engine.py", "test_engine_multinode_dp.py",
              "test_engine_restart.py", "test_llmd_indexer.py", "test_engine_pp_uneven.py",
              "test_engine_multinode.py", "test_router_engines.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/contract" in str(item.path):
            item.add_marker(pytest.mark.contract)
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    # a stable sort: each file's tests keep their order, the other files theirs
    items.sort(key=lambda item: rank.get(item.path.name, len(rank))
               if "tests/contract" in str(item.path) else len(rank))


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
