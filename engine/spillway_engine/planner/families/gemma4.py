"""Gemma 4: sliding-window layers and full layers with their own head size and KV heads."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    attention_shape,
    sliding_window_of,
    text_config,
)

_DEFAULTS = {
    "sliding_window": 512,
    "head_dim": 256,
    "global_head_dim": 512,
    "max_position_embeddings": 131072,
}


def _gemma4(config: dict[str, Any], arch: str) -> ModelShape:
    """``gemma4.py`` with transformers' Gemma4TextConfig: full layers take
    ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``;
    the last ``num_kv_shared_layers`` layers reuse an earlier layer's cache and own none."""
    cfg = text_config(config, _DEFAULTS)
    if cfg.has("per_layer_config"):
        raise UnsupportedModel(f"{arch} with an explicit per_layer_config is not modelled")
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModel(f"{arch} with bidirectional attention on all tokens is not modelled")
    n = cfg.int("num_hidden_layers")
    layer_types = list(
        cfg.str_list("layer_types", n)
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    )
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModel(f"{arch}: layer types {unknown} are not modelled")
    layer_types[-1] = "full_attention"  # transformers forces the last layer global
    window = sliding_window_of(cfg)
    global_head = cfg.int("global_head_dim")
    global_kv: int | None = None
    if cfg.get("attention_k_eq_v", False) and cfg.has("num_global_key_value_heads"):
        global_kv = cfg.int("num_global_key_value_heads")
    shared = cfg.int("num_kv_shared_layers", 0, minimum=0)
    if shared >= n:
        raise UnsupportedModel(f"{arch}: every layer shares another layer's KV cache")
    for t in set(layer_types[n - shared :]):
        if t not in layer_types[: n - shared]:
            raise UnsupportedModel(f"{arch}: a KV-shared {t} layer has no earlier {t} layer")
    sliding = LayerKind("sliding_window", window)
    full = LayerKind("full_attention", num_kv_heads=global_kv, head_size=global_head)
    layers = tuple(
        sliding if t == "sliding_attention" and window else full
        for t in layer_types[: n - shared]
    )
    notes = (f"{shared} KV-shared layers own no cache",) if shared else ()
    refusal = (
        f"{arch} with {shared} KV-shared layers: pipeline parallelism is not modelled (a "
        "shared layer reads an earlier layer's cache, which may sit on another stage)"
        if shared
        else None
    )
    return attention_shape(
        config, cfg, arch, layers, model_type="gemma4_text", notes=notes,
        num_hidden_layers=n, pipeline_refusal=refusal,
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "Gemma4ForCausalLM": _gemma4,
}
