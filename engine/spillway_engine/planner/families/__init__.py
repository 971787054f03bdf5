"""One KV-layout rule per architecture family; ``model_shape`` picks the rule for a config.

Each module reads what its family's vLLM 0.33.0 model file allocates per layer and
exposes ``ARCHITECTURES`` (architecture name -> rule). Adding a family is one module
and one line below.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.families import (
    deepseek_mla,
    dense,
    gemma,
    gemma4,
    gpt_oss,
    granite_hybrid,
    jamba,
    kimi_linear,
    llama4,
    nemotron_h,
    qwen3_next,
    step3p5,
)
from spillway_engine.planner.shape import ModelConfigError, ModelShape, ShapeRule, UnsupportedModel

_ARCHITECTURES: dict[str, ShapeRule] = {
    **dense.ARCHITECTURES,
    **gemma.ARCHITECTURES,
    **gemma4.ARCHITECTURES,
    **gpt_oss.ARCHITECTURES,
    **llama4.ARCHITECTURES,
    **deepseek_mla.ARCHITECTURES,
    **qwen3_next.ARCHITECTURES,
    **jamba.ARCHITECTURES,
    **nemotron_h.ARCHITECTURES,
    **granite_hybrid.ARCHITECTURES,
    **kimi_linear.ARCHITECTURES,
    **step3p5.ARCHITECTURES,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The layout-relevant facts of ``config`` (a parsed config.json)."""
    if not isinstance(config, dict):
        raise ModelConfigError("config.json must be a JSON object")
    archs = config.get("architectures")
    if not archs:
        raise ModelConfigError("config.json: missing 'architectures'")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError("config.json: 'architectures' must be a list of names")
    arch = archs[0]
    adapter = _ARCHITECTURES.get(arch)
    if adapter is None:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported by the Spillway planner (no KV-layout "
            f"rule for it); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = adapter(config, arch)
    if not shape.layers:
        raise ModelConfigError("config.json: the model has no layers")
    return shape
