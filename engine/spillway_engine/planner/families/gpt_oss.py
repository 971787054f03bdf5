"""gpt-oss: alternating sliding-window and full layers, all with attention sinks."""

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


def _gpt_oss(config: dict[str, Any], arch: str) -> ModelShape:
    """gpt-oss: even layers slide (``gpt_oss.py`` ignores layer_types), all have sinks."""
    cfg = text_config(config, {"sliding_window": 128, "head_dim": 64})
    n = cfg.int("num_hidden_layers")
    window = sliding_window_of(cfg)
    sliding, full = LayerKind("sliding_window", window), LayerKind("full_attention")
    layers = tuple(sliding if i % 2 == 0 and window else full for i in range(n))
    return attention_shape(
        config,
        cfg,
        arch,
        layers,
        model_type="gpt_oss",
        sinks=True,
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "GptOssForCausalLM": _gpt_oss,
}
