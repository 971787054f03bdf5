"""Gemma 2 and 3: interleaved sliding-window and full-attention layers."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelShape,
    ShapeRule,
    attention_shape,
    sliding_window_of,
    text_config,
)

_GEMMA2_DEFAULTS = {"sliding_window": 4096, "head_dim": 256, "num_key_value_heads": 8}
_GEMMA3_DEFAULTS = {
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "head_dim": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 26,
    "max_position_embeddings": 131072,
}


def _gemma(config: dict[str, Any], arch: str) -> ModelShape:
    """Gemma 2/3: interleaved sliding-window and full layers (``gemma2.py``, ``gemma3.py``)."""
    gemma3 = arch.startswith("Gemma3")
    cfg = text_config(config, _GEMMA3_DEFAULTS if gemma3 else _GEMMA2_DEFAULTS)
    n = cfg.int("num_hidden_layers")
    window = sliding_window_of(cfg)
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:
        # transformers' derivation: every pattern-th layer is global.
        pattern = cfg.int("sliding_window_pattern", 6) if gemma3 else 2
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
    sliding, full = LayerKind("sliding_window", window), LayerKind("full_attention")
    layers = tuple(sliding if t == "sliding_attention" and window else full for t in layer_types)
    return attention_shape(
        config,
        cfg,
        arch,
        layers,
        # Gemma 3 with a vision tower is a prefix-LM: vLLM picks a composite backend.
        mm_prefix=arch == "Gemma3ForConditionalGeneration",
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "Gemma3ForConditionalGeneration": _gemma,
}
