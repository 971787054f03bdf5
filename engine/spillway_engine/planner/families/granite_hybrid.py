"""Granite-4.0-H: Mamba-2 layers with a few (NoPE) attention layers, per ``layer_types``."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    ConfigReader,
    LayerKind,
    MambaState,
    ModelConfigError,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    attention_shape,
    divide_for_tp,
    text_config,
)

_DEFAULTS = {
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 2048,
}


def _granite_hybrid(config: dict[str, Any], arch: str) -> ModelShape:
    """``granitemoehybrid.py``: ``layer_types`` of "mamba" / "attention"; transformers
    makes every layer Mamba when it is absent. The attention head size is always
    hidden_size / num_attention_heads (a head_dim key is ignored)."""
    cfg = text_config(config, _DEFAULTS)
    n = cfg.int("num_hidden_layers")
    layer_types = (
        cfg.str_list("layer_types", n) or cfg.str_list("layers_block_type", n) or ["mamba"] * n
    )
    unknown = sorted(set(layer_types) - {"mamba", "attention"})
    if unknown:
        raise UnsupportedModel(f"{arch}: layer types {unknown} are not modelled")
    mamba, attention = LayerKind("mamba"), LayerKind("full_attention")  # shared: see layer_specs
    layers = tuple(mamba if t == "mamba" else attention for t in layer_types)
    hidden = cfg.int("hidden_size")
    inner = cfg.int("mamba_expand") * hidden
    m_heads = cfg.int("mamba_n_heads")
    d_head_raw = cfg.get("mamba_d_head", "auto")
    head_dim = inner // m_heads if d_head_raw == "auto" else cfg.int("mamba_d_head")
    if head_dim * m_heads != inner:
        raise ModelConfigError(
            f"{cfg.where}: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size"
        )
    groups, d_state = cfg.int("mamba_n_groups"), cfg.int("mamba_d_state")
    kernel = cfg.int("mamba_d_conv")

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.mamba2_state_shape; mamba2_state_dtype: both states
        # in the model dtype unless --mamba-ssm-cache-dtype is set.
        n_groups = groups if groups % tp == 0 else tp
        conv_dim = inner + 2 * n_groups * d_state
        return [
            (divide_for_tp(conv_dim, tp, "Mamba-2 conv dim") * (kernel - 1 + num_spec), dtype),
            (divide_for_tp(m_heads, tp, "mamba_n_heads") * head_dim * d_state, dtype),
        ]

    heads = cfg.int("num_attention_heads")
    attention = ConfigReader(
        {**cfg.data, "head_dim": None, "hidden_size": hidden, "num_attention_heads": heads},
        cfg.where,
    )
    return attention_shape(
        config,
        attention,
        arch,
        layers,
        model_type="granitemoehybrid",
        mamba=MambaState("mamba2", states),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "GraniteMoeHybridForCausalLM": _granite_hybrid,
}
