"""One KV-layout rule per architecture family; ``model_shape`` picks the rule for a config.

Each module reads what its family's vLLM 0.33.0 model file allocates per layer and
exposes ``ARCHITECTURES`` (architecture name -> rule). Adding a family is one module
and one line below.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.families import (
    deepseek_mla,
    deepseek_sparse,
    deepseek_v4,
    dense,
    gemma,
    gemma4,
    glm5next,
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
    **glm5next.ARCHITECTURES,
    **gpt_oss.ARCHITECTURES,
    **llama4.ARCHITECTURES,
    **deepseek_mla.ARCHITECTURES,
    **deepseek_sparse.ARCHITECTURES,
    **deepseek_v4.ARCHITECTURES,
    **qwen3_next.ARCHITECTURES,
    **jamba.ARCHITECTURES,
    **nemotron_h.ARCHITECTURES,
    **granite_hybrid.ARCHITECTURES,
    **kimi_linear.ARCHITECTURES,
    **step3p5.ARCHITECTURES,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))

#: Architectures vLLM 0.33.0 serves whose KV layout Spillway knows it does not reproduce.
NOT_YET_MODELLED: dict[str, str] = {
    "Gemma4ForConditionalGeneration": (
        "the multimodal Gemma 4 (a prefix-LM with a vision tower) is not modelled; the "
        "text-only Gemma4ForCausalLM is (on Ampere/Ada GPUs)"
    ),
    "Qwen3_5ForConditionalGeneration": (
        "the multimodal Qwen3.5 wrapper is not modelled; a config.json whose text_config "
        "is flattened with architectures Qwen3_5ForCausalLM is"
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "the multimodal Qwen3.5-MoE wrapper is not modelled; a config.json whose "
        "text_config is flattened with architectures Qwen3_5MoeForCausalLM is"
    ),
}

#: Where to ask for an architecture the planner does not know.
HOW_TO_ASK = (
    "open an issue titled 'planner: support <architecture>' with the model's "
    "config.json (or its Hugging Face id) and the vllm serve flags you use"
)


def unsupported_message(arch: str) -> str:
    """Why ``arch`` cannot be planned, the supported list, and how to ask for it."""
    reason = NOT_YET_MODELLED.get(arch, "no KV-layout rule for it")
    return (
        f"architecture {arch!r} is not supported by the Spillway planner ({reason}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}; to ask for it, {HOW_TO_ASK}"
    )


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
        raise UnsupportedModel(unsupported_message(arch))
    shape = adapter(config, arch)
    if not shape.layers:
        raise ModelConfigError("config.json: the model has no layers")
    return shape
