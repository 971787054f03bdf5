"""Jamba: Mamba-1 layers with an attention layer every few layers."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    MambaState,
    ModelShape,
    ShapeRule,
    attention_shape,
    divide_for_tp,
    text_config,
)


def _jamba(config: dict[str, Any], arch: str) -> ModelShape:
    """Jamba: Mamba-1 layers with attention every ``attn_layer_period``-th layer."""
    cfg = text_config(config, {"attn_layer_period": 8, "attn_layer_offset": 4})
    n = cfg.int("num_hidden_layers")
    period, offset = cfg.int("attn_layer_period"), cfg.int("attn_layer_offset", minimum=0)
    attention, mamba = LayerKind("full_attention"), LayerKind("mamba")  # shared: see layer_specs
    layers = tuple(attention if i % period == offset else mamba for i in range(n))
    inner = cfg.int("mamba_expand", 2) * cfg.int("hidden_size")
    d_state, d_conv = cfg.int("mamba_d_state", 16), cfg.int("mamba_d_conv", 4)

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.mamba1_state_shape (no speculative rows)
        dim = divide_for_tp(inner, tp, "Mamba intermediate size")
        return [(dim * (d_conv - 1), dtype), (dim * d_state, dtype)]

    return attention_shape(
        config,
        cfg,
        arch,
        layers,
        model_type="jamba",
        mamba=MambaState("mamba1", states),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "JambaForCausalLM": _jamba,
}
