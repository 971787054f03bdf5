"""DeepSeek sparse attention (DSA): DeepSeek-V3.2 and GLM-5 (``GlmMoeDsaForCausalLM``).

vLLM 0.33.0 (``vllm/models/deepseek_v32``; ``model_executor/models/deepseek_v2.py``
off CUDA, same layers) gives each decoder layer an MLA latent cache on sparse-MLA
kernels and, unless the IndexCache pattern skips it, a lightning-indexer key cache
(``DeepseekV32IndexerCache``): an ``MLAAttentionSpec`` of ``index_head_dim`` uint8 keys
plus 4 bytes of scale per 128 of them, whatever the KV dtype, registered just before
its layer's latent. Both are MLA specs of one block size with different pages, so vLLM
puts every layer in one ``UniformTypeKVCacheSpecs`` group. The latent's bytes follow the
SM90 backend (gpus.py): 576 x 16-bit (FLASH_ATTN_MLA_SPARSE), FlashMLA's 656 B
fp8_ds_mla with ``fp8``, FlashInfer's plain 576 B rows with ``fp8_e4m3``.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    LayerKind,
    ModelShape,
    ShapeRule,
    SparseMlaDims,
    UnsupportedModel,
    derived_max_len,
    model_dtype,
    text_config,
)

#: DeepseekV32Indexer.quant_block_size: one 4-byte scale per 128 key elements
_INDEXER_QUANT_BLOCK = 128


def _has_indexer(layer_id: int, cfg: Any) -> bool:
    """``DeepseekV32Attention``: IndexCache skips the indexer on some layers."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is None:
        freq = cfg.int("index_topk_freq", 1)
        offset = cfg.int("index_skip_topk_offset", 2, minimum=0)
        return max(layer_id - offset + 1, 0) % freq == 0
    if not isinstance(pattern, (str, list)):
        raise UnsupportedModel("config.json: index_topk_pattern must be a string or list")
    return not (0 <= layer_id < len(pattern) and pattern[layer_id] == "S")


def _deepseek_sparse(config: dict[str, Any], arch: str) -> ModelShape:
    cfg = text_config(config, {})
    for key in ("kv_lora_rank", "index_topk", "index_head_dim"):
        if not cfg.has(key):
            raise UnsupportedModel(f"{arch} without {key} is not a sparse-attention config")
    n = cfg.int("num_hidden_layers")
    rope = cfg.int("qk_rope_head_dim", 0, minimum=0)
    latent = cfg.int("kv_lora_rank") + rope
    dims = SparseMlaDims(
        kv_lora_rank=cfg.int("kv_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=cfg.int("qk_nope_head_dim", 0, minimum=0),
        index_topk=cfg.int("index_topk"),
        # models/config.py GlmMoeDsaForCausalLM: an fp8 cache by default on SM10x
        sm10x_auto_kv_dtype="fp8_e4m3" if arch == "GlmMoeDsaForCausalLM" else None,
    )
    head = cfg.int("index_head_dim")
    indexer = LayerKind("mla", bytes_per_token=head + head // _INDEXER_QUANT_BLOCK * 4)
    mla = LayerKind("mla")
    layers: list[LayerKind] = []
    positions: list[int] = []
    for i in range(n):
        if _has_indexer(i, cfg):
            layers.append(indexer)
            positions.append(i)
        layers.append(mla)
        positions.append(i)
    skipped = n - layers.count(indexer)
    notes = (
        (f"{skipped} layers reuse an earlier layer's top-k (no indexer cache)",) if skipped else ()
    )
    # deepseek_mtp.py: MTP layers always build an indexer (layer_id >= num_hidden_layers)
    mtp = cfg.int("num_nextn_predict_layers", 0, minimum=0)
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=model_dtype(config, cfg.data),
        layers=tuple(layers),
        num_attention_heads=cfg.int("num_attention_heads"),
        num_kv_heads=1,
        head_size=latent,
        head_size_v=0,
        mla_latent=latent,
        sparse_mla=True,
        sparse_dims=dims,
        derived_max_model_len=derived_max_len(cfg),
        mtp_layers=(indexer, mla) * mtp,
        num_hidden_layers=n,
        layer_positions=tuple(positions),
        notes=(
            f"sparse MLA: a {indexer.bytes_per_token}-byte indexer key beside each "
            f"{latent}-wide latent",
            *notes,
        ),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "DeepseekV32ForCausalLM": _deepseek_sparse,
    "GlmMoeDsaForCausalLM": _deepseek_sparse,
}
