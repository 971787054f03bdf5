"""Nemotron-H: Mamba-2 and attention layers in a per-layer pattern."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    TORCH_DTYPE_NAMES,
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


def _nemotron_h(config: dict[str, Any], arch: str) -> ModelShape:
    """Nemotron-H: ``hybrid_override_pattern`` of M (Mamba-2), * (attention), - / E (MLP)."""
    cfg = text_config(config, {})
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ModelConfigError("config.json: missing 'hybrid_override_pattern'")
    unknown = set(pattern) - set("M*-E")
    if unknown:
        raise UnsupportedModel(f"{arch}: layer codes {sorted(unknown)} are not modelled")
    mamba, attention = LayerKind("mamba"), LayerKind("full_attention")  # shared: see layer_specs
    layers = tuple(mamba if c == "M" else attention for c in pattern if c in "M*")
    m_heads, head_dim = cfg.int("mamba_num_heads"), cfg.int("mamba_head_dim")
    groups, d_state = cfg.int("n_groups"), cfg.int("ssm_state_size")
    kernel = cfg.int("conv_kernel")
    # NemotronHForCausalLMConfig: the SSM state defaults to float32 (accuracy).
    ssm_dtype = TORCH_DTYPE_NAMES.get(str(cfg.get("mamba_ssm_cache_dtype", "float32")))
    if ssm_dtype is None:
        raise ModelConfigError("config.json: unknown mamba_ssm_cache_dtype")

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.mamba2_state_shape: groups grow to cover head shards.
        n_groups = groups if groups % tp == 0 else tp
        conv_dim = m_heads * head_dim + 2 * n_groups * d_state
        return [
            (divide_for_tp(conv_dim, tp, "Mamba-2 conv dim") * (kernel - 1 + num_spec), dtype),
            (divide_for_tp(m_heads, tp, "mamba_num_heads") * head_dim * d_state, ssm_dtype),
        ]

    return attention_shape(
        config,
        cfg,
        arch,
        layers,
        model_type="nemotron_h",
        mamba=MambaState("mamba2", states),
        # the MLP / MoE layers ("-", "E") hold no cache but take part in the PP split
        num_hidden_layers=len(pattern),
        layer_positions=tuple(i for i, c in enumerate(pattern) if c in "M*"),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "NemotronHForCausalLM": _nemotron_h,
}
