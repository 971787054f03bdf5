"""DeepSeek-V2/V3 and Kimi-K2: multi-head latent attention (MLA)."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    derived_max_len,
    model_dtype,
    text_config,
)


def _deepseek_mla(config: dict[str, Any], arch: str) -> ModelShape:
    """DeepSeek-V2/V3 and Kimi-K2: MLA, one latent of kv_lora_rank + rope dims per token."""
    cfg = text_config(config, {})
    if cfg.has("index_topk"):
        raise UnsupportedModel(
            f"{arch} with a sparse-attention indexer (index_topk) is not modelled: the "
            "indexer cache forms a UniformType group Spillway does not reproduce"
        )
    if not cfg.has("kv_lora_rank"):
        raise UnsupportedModel(f"{arch} without kv_lora_rank (non-MLA DeepSeek) is not modelled")
    n = cfg.int("num_hidden_layers")
    latent = cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=model_dtype(config, cfg.data),
        layers=(LayerKind("mla"),) * n,  # one shared object: see layer_specs
        num_attention_heads=cfg.int("num_attention_heads"),
        num_kv_heads=1,
        head_size=latent,
        head_size_v=0,
        mla_latent=latent,
        derived_max_model_len=derived_max_len(cfg),
        # deepseek_mtp.py: num_nextn_predict_layers MLA layers, used with method=mtp
        mtp_layers=(LayerKind("mla"),) * cfg.int("num_nextn_predict_layers", 0, minimum=0),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "DeepseekV2ForCausalLM": _deepseek_mla,
    "DeepseekV3ForCausalLM": _deepseek_mla,
}
