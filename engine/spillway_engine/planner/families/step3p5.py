"""Step-3.5: interleaved sliding-window and full GQA layers sharing one KV-head count."""

from __future__ import annotations

import math
from typing import Any

from spillway_engine.planner.shape import (
    ConfigReader,
    LayerKind,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    attention_shape,
    sliding_window_of,
    text_config,
)


def _step3p5(config: dict[str, Any], arch: str) -> ModelShape:
    """``step3p5.py``: every layer has ``num_attention_groups`` KV heads of ``head_dim``;
    sliding layers take ``sliding_window`` and their own query-head count
    (``num_sliding_attention_heads`` or ``attention_other_setting``)."""
    cfg = text_config(config, {})
    if cfg.get("att_impl_type", "GQA") != "GQA":
        raise UnsupportedModel(
            f"{arch}: Unsupported attention implementation: {cfg.get('att_impl_type')}"
        )
    n = cfg.int("num_hidden_layers")
    # layer_types may also list the trailing MTP layers; the target model has n
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:
        raise UnsupportedModel(f"{arch} without layer_types is not modelled")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModel(f"{arch}: layer types {unknown} are not modelled")
    window = sliding_window_of(cfg)
    sliding, full = LayerKind("sliding_window", window), LayerKind("full_attention")
    layers = tuple(sliding if t == "sliding_attention" and window else full for t in layer_types)
    kv_heads = cfg.int("num_attention_groups", None) or cfg.int("num_key_value_heads")
    heads = cfg.int("num_attention_heads")
    other = cfg.get("attention_other_setting") or {}
    sliding_heads = cfg.get("num_sliding_attention_heads") or (
        other.get("num_attention_heads")
        if other.get("attention_type") == "sliding_attention"
        else None
    )
    head_dim = cfg.int("head_dim") if cfg.has("head_dim") else cfg.int("hidden_size") // heads
    # Tensor parallelism must split both query-head counts; their gcd is divisible by
    # exactly the TP sizes that divide both.
    split_heads = math.gcd(heads, int(sliding_heads)) if sliding_heads else heads
    attention = ConfigReader(
        {
            **cfg.data,
            "num_attention_heads": split_heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
        },
        cfg.where,
    )
    return attention_shape(config, attention, arch, layers, model_type="step3p5")


ARCHITECTURES: dict[str, ShapeRule] = {
    "Step3p5ForCausalLM": _step3p5,
}
