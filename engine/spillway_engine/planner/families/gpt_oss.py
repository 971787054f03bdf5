"""gpt-oss: alternating sliding-window and full layers, all with attention sinks."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelShape,
    ShapeRule,
    attention_heads,
    derived_max_len,
    model_dtype,
    sliding_window_of,
    text_config,
)


def _gpt_oss(config: dict[str, Any], arch: str) -> ModelShape:
    """gpt-oss: even layers slide (``gpt_oss.py`` ignores layer_types), all have sinks."""
    cfg = text_config(config, {"sliding_window": 128, "head_dim": 64})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = attention_heads(cfg)
    window = sliding_window_of(cfg)
    layers = tuple(
        LayerKind("sliding_window", window)
        if i % 2 == 0 and window
        else LayerKind("full_attention")
        for i in range(n)
    )
    return ModelShape(
        architecture=arch,
        model_type="gpt_oss",
        dtype=model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        sinks=True,
        derived_max_model_len=derived_max_len(cfg),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "GptOssForCausalLM": _gpt_oss,
}
