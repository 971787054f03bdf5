"""EAGLE-3 heads (``--speculative-config '{"method": "eagle3", "model": ...}'``).

vLLM 0.33.0 wraps the head's config.json in ``EAGLEConfig`` (``LlamaForCausalLM`` ->
``Eagle3LlamaForCausalLM``) and builds ``llama_eagle3.py``: ``num_hidden_layers``
Llama decoder layers whose attention (``llama.py``'s ``LlamaAttention``) takes the
head's own heads and head size. Heads vLLM builds with another model file (Qwen3,
DeepSeek EAGLE-3) are refused by name.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.families.dense import ARCHITECTURES as DENSE
from spillway_engine.planner.shape import ModelConfigError, ModelShape, UnsupportedModel

#: Head architectures vLLM 0.33.0 builds with ``llama_eagle3.Eagle3LlamaForCausalLM``
#: (``EAGLEConfig`` prefixes a plain name with "Eagle3").
LLAMA_EAGLE3 = frozenset(
    {
        "LlamaForCausalLM",
        "LlamaForCausalLMEagle3",
        "Eagle3LlamaForCausalLM",
        "PEagleDraftModel",
        "PeagleLlamaForCausalLM",
        "Eagle3MiniMaxM2ForCausalLM",
    }
)


def eagle3_shape(config: dict[str, Any]) -> ModelShape:
    """The EAGLE-3 head's cache layers (Llama attention with its own heads)."""
    if not isinstance(config, dict):
        raise ModelConfigError("the EAGLE-3 head's config.json must be a JSON object")
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError("EAGLE-3 config.json: 'architectures' must be a list of names")
    if archs[0] not in LLAMA_EAGLE3:
        raise UnsupportedModel(
            f"EAGLE-3 head architecture {archs[0]!r} is not modelled (only heads vLLM builds "
            f"as Eagle3LlamaForCausalLM: {', '.join(sorted(LLAMA_EAGLE3))})"
        )
    shape = DENSE["LlamaForCausalLM"](config, archs[0])
    if not shape.layers:
        raise ModelConfigError("EAGLE-3 config.json: the head has no layers")
    return shape
