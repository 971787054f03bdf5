"""Llama 4: chunked local attention with a global NoPE layer every few layers."""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelConfigError,
    ModelShape,
    ShapeRule,
    attention_shape,
    text_config,
)


def _llama4(config: dict[str, Any], arch: str) -> ModelShape:
    """Llama 4: chunked local attention, with a global NoPE layer every interval-th layer."""
    cfg = text_config(config, {"no_rope_layer_interval": 4, "attention_chunk_size": 8192})
    n = cfg.int("num_hidden_layers")
    chunk = cfg.int("attention_chunk_size")
    rope = cfg.get("no_rope_layers") or None  # transformers treats [] as "derive it"
    if rope is None:
        interval = cfg.int("no_rope_layer_interval")
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(rope, list) or len(rope) < n:
        raise ModelConfigError(f"{cfg.where}: 'no_rope_layers' needs one entry per layer")
    # llama4.py: RoPE layers are chunked-local, NoPE layers (0) are global
    local = LayerKind("chunked_local", attention_chunk_size=chunk)
    full = LayerKind("full_attention")
    layers = tuple(local if rope[i] else full for i in range(n))
    return attention_shape(
        config,
        cfg,
        arch,
        layers,
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "Llama4ForCausalLM": _llama4,
    "Llama4ForConditionalGeneration": _llama4,
}
