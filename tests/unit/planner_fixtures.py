"""Model configs for planner unit tests (copied public config.json facts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def load_model(name: str) -> dict[str, Any]:
    """The config.json dict of ``tests/fixtures/models/<name>.json``."""
    data = json.loads((MODELS / f"{name}.json").read_text())
    return data["config"]


FRONTIER = Path(__file__).resolve().parents[1] / "contract" / "frontier_configs"


def load_frontier(name: str) -> dict[str, Any]:
    """The config.json dict of ``tests/contract/frontier_configs/<name>.json``."""
    return json.loads((FRONTIER / f"{name}.json").read_text())["config"]
