"""Qwen3-Next and Qwen3.5: Gated DeltaNet (GDN) linear-attention layers plus full attention."""

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


def _qwen3_next(config: dict[str, Any], arch: str) -> ModelShape:
    """Qwen3-Next / Qwen3.5 (``qwen3_next.py``, ``qwen3_5.py``): gated-delta-net (GDN)
    layers + full attention every interval-th layer; the same GDN state rule."""
    cfg = text_config(config, {"full_attention_interval": 4, "head_dim": 256})
    n = cfg.int("num_hidden_layers")
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:
        interval = cfg.int("full_attention_interval")
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    layers = []
    attention, gdn = LayerKind("full_attention"), LayerKind("mamba")  # shared: see layer_specs
    for t in layer_types:
        if t not in ("full_attention", "linear_attention"):
            raise UnsupportedModel(f"{arch}: layer type {t!r} is not modelled")
        layers.append(attention if t == "full_attention" else gdn)
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_dim, v_dim = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    kernel = cfg.int("linear_conv_kernel_dim")
    mtp_key = "mtp_num_hidden_layers" if arch.startswith("Qwen3_5") else "num_nextn_predict_layers"
    mtp = cfg.int(mtp_key, 0, minimum=0)
    ssm_dtype: str | None = None
    if arch.startswith("Qwen3_5") and cfg.has("mamba_ssm_dtype"):
        # Qwen3_5ForCausalLMConfig: the config's mamba_ssm_dtype becomes the SSM
        # state dtype when --mamba-ssm-cache-dtype is left at auto.
        ssm_dtype = TORCH_DTYPE_NAMES.get(str(cfg.get("mamba_ssm_dtype")))
        if ssm_dtype is None:
            raise ModelConfigError(f"{cfg.where}: unknown mamba_ssm_dtype")

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.gated_delta_net_state_shape
        conv_dim = divide_for_tp(k_dim * k_heads * 2 + v_dim * v_heads, tp, "GDN conv dim")
        return [
            (conv_dim * (kernel - 1 + num_spec), dtype),
            (
                divide_for_tp(v_heads, tp, "linear_num_value_heads") * v_dim * k_dim,
                ssm_dtype or dtype,
            ),
        ]

    return attention_shape(
        config,
        cfg,
        arch,
        tuple(layers),
        mamba=MambaState("gdn", states),
        gdn=True,
        gdn_head_k_dim=k_dim,
        # qwen3_next_mtp.py / qwen3_5_mtp.py: full-attention MTP layers
        mtp_layers=(attention,) * mtp,
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "Qwen3NextForCausalLM": _qwen3_next,
    "Qwen3_5ForCausalLM": _qwen3_next,
    "Qwen3_5MoeForCausalLM": _qwen3_next,
}
