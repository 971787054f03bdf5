"""Kimi-Linear: Kimi Delta Attention (KDA) linear-attention layers plus MLA layers."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    MambaState,
    ModelConfigError,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    derived_max_len,
    divide_for_tp,
    model_dtype,
    text_config,
)


def _kimi_linear(config: dict[str, Any], arch: str) -> ModelShape:
    """``models/kimi_k3/nvidia/model.py``: layer i is KDA when i+1 is in
    ``linear_attn_config.kda_layers``, else an MLA layer (NoPE, latent = kv_lora_rank
    + qk_rope_head_dim)."""
    # vLLM's own KimiLinearConfig defaults the context to 4096 tokens
    cfg = text_config(config, {"max_position_embeddings": 4096})
    n = cfg.int("num_hidden_layers")
    linear = cfg.get("linear_attn_config")
    if not isinstance(linear, dict):
        raise ModelConfigError(f"{cfg.where}: missing 'linear_attn_config'")
    kda_layers = linear.get("kda_layers")
    if not isinstance(kda_layers, list) or not all(isinstance(i, int) for i in kda_layers):
        raise ModelConfigError(f"{cfg.where}: 'linear_attn_config.kda_layers' must list layers")
    if linear.get("use_full_rank_gate", False):
        raise UnsupportedModel(f"{arch} with use_full_rank_gate (Kimi-K3's KDA) is not modelled")
    if cfg.get("mla_use_nope") is not True:
        # vLLM asserts it while building the model
        raise UnsupportedModel(f"{arch}: Kimi-K3 MLA (MultiHeadLatentAttention) is NoPE-only")
    kda = set(kda_layers)
    kda_layer, mla = LayerKind("mamba"), LayerKind("mla")  # shared: see layer_specs
    layers = tuple(kda_layer if i + 1 in kda else mla for i in range(n))
    linear_cfg = type(cfg)(linear, f"{cfg.where} linear_attn_config")
    heads, head_dim = linear_cfg.int("num_heads"), linear_cfg.int("head_dim")
    kernel = linear_cfg.int("short_conv_kernel_size", 4)
    latent = cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.kda_state_shape / kda_state_dtype: q, k, v short
        # convolutions in the model dtype, the recurrent state in float32 ("auto").
        conv_dim = divide_for_tp(3 * heads * head_dim, tp, "KDA conv dim")
        recurrent = divide_for_tp(heads, tp, "linear_attn_config.num_heads")
        return [
            (conv_dim * (kernel - 1 + num_spec), dtype),
            (recurrent * head_dim * head_dim, "float32"),
        ]

    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=cfg.int("num_attention_heads"),
        num_kv_heads=1,
        head_size=latent,
        head_size_v=0,
        mla_latent=latent,
        mamba=MambaState("kda", states),
        derived_max_model_len=derived_max_len(cfg),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "KimiLinearForCausalLM": _kimi_linear,
}
