"""Llama-style dense and MoE decoders: full attention, sliding windows from layer_types."""

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


def _dense(config: dict[str, Any], arch: str) -> ModelShape:
    """Llama-style decoders (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``phi3``...)."""
    cfg = text_config(config, {})
    n = cfg.int("num_hidden_layers")
    model_type = str(cfg.get("model_type", ""))
    window = sliding_window_of(cfg)
    notes: list[str] = []
    layer_types = cfg.str_list("layer_types", n)
    if model_type.startswith(("qwen2", "qwen3")):
        if not cfg.get("use_sliding_window", False):
            window = None  # transformers drops the window unless use_sliding_window is set
        if layer_types is None:  # transformers' derivation
            first = cfg.int("max_window_layers", 28, minimum=0)
            layer_types = [
                "sliding_attention" if window and i >= first else "full_attention" for i in range(n)
            ]
        if len(set(layer_types)) > 1:
            raise UnsupportedModel(
                f"{arch} with a sliding window on only some layers (max_window_layers < "
                "num_hidden_layers) is rejected by vLLM 0.33.0"
            )
    layers: list[LayerKind] = []
    full = LayerKind("full_attention")
    slid = {window: LayerKind("sliding_window", window)} if window else {}
    for i in range(n):
        # llama.py: "sliding_attention" layers take config.sliding_window; other layers
        # fall back to CacheConfig.sliding_window, which EngineArgs only sets when there
        # are no layer_types or all of them slide.
        if layer_types is None:
            sliding = window
        elif layer_types[i] in ("sliding_attention", "full_attention"):
            sliding = window if layer_types[i] == "sliding_attention" else None
        else:
            raise UnsupportedModel(f"{arch}: layer type {layer_types[i]!r} is not modelled")
        layers.append(slid[sliding] if sliding else full)
    if window and all(layer.kind == "sliding_window" for layer in layers):
        notes.append(f"sliding window {window} on every layer (config sliding_window)")
    return attention_shape(
        config,
        cfg,
        arch,
        tuple(layers),
        model_type=model_type,
        notes=tuple(notes),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "LlamaForCausalLM": _dense,
    "MistralForCausalLM": _dense,
    "MixtralForCausalLM": _dense,
    "Qwen2ForCausalLM": _dense,
    "Qwen2MoeForCausalLM": _dense,
    "Qwen3ForCausalLM": _dense,
    "Qwen3MoeForCausalLM": _dense,
    "Phi3ForCausalLM": _dense,
    # minimax_m2.py: GQA full attention on every layer (partial RoPE, QK-norm)
    "MiniMaxM2ForCausalLM": _dense,
    # vLLM's Transformers backend: per-layer sliding windows from layer_types
    "Olmo3ForCausalLM": _dense,
}
