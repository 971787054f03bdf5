"""DeepSeek-V4's compressed sparse attention (``DeepseekV4ForCausalLM``).

vLLM 0.33.0 (``vllm/models/deepseek_v4``: ``attention.py``, ``compressor.py``,
``v1/attention/backends/mla/sparse_swa.py``) registers per decoder layer, in this order:

* at compress ratio 4 a lightning indexer: its compressed key cache
  (``DeepseekV4IndexerCache``: ``MLAAttentionSpec``, ``tokens_per_state`` 4, 128 fp8
  keys + 4 B of scale a state) and its compressor's float32 state cache;
* a sliding-window latent (``DeepseekV4SWACache``: ``SlidingWindowMLASpec``, the
  config's window, its own 64-token blocks);
* where the ratio is above 1, the compressed latent (the attention layer itself:
  ``MLAAttentionSpec``, ``tokens_per_state`` = the ratio, on the scheduler's block) and
  its compressor's float32 states (``CompressorStateCache``: ``SlidingWindowMLASpec``
  of ``2 x coff x head_dim`` floats a token, window ``coff x ratio``, 4-token blocks at
  ratio 4 and 8-token ones at 128; ``coff`` is 2 at ratio 4, else 1).

On Hopper every latent is FlashMLA's fp8_ds_mla row (584 B a token, whatever
``--kv-cache-dtype`` says among auto/fp8) and every page rounds up to 576 B. MTP
layers (``DeepSeekV4MTP``, only built with ``--speculative-config method=mtp``) are
sliding-window-only: a layer past ``num_hidden_layers`` has compress ratio 1.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.gpus import (
    DSV4_FP8_DS_MLA_BYTES_PER_TOKEN,
    DSV4_FP8_DS_MLA_PAGE_ALIGNMENT,
)
from spillway_engine.planner.shape import (
    LayerKind,
    ModelConfigError,
    ModelShape,
    ShapeRule,
    UnsupportedModel,
    derived_max_len,
    model_dtype,
    text_config,
)

#: DeepseekV4Indexer.quant_block_size: one 4-byte scale per 128 key elements
_INDEXER_QUANT_BLOCK = 128
#: CompressorStateCache: own block sizes by ratio (pages shared with the KV blocks)
_STATE_BLOCK = {4: 4, 128: 8}
#: DeepseekV4SWACache's own block size
_SWA_BLOCK = 64
_FLOAT32 = 4
#: transformers' DeepseekV4Config: layer type -> ratio (sliding_attention is 0)
_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _ratios(cfg: Any, n: int) -> list[int]:
    """Each layer's compress ratio (0: sliding window only), as
    ``get_compress_ratios``: the legacy ``compress_ratios`` list (its extra entries are
    the MTP layers) or ``layer_types`` with ``compress_rates``."""
    ratios = cfg.get("compress_ratios")
    if ratios is None:
        types = cfg.str_list("layer_types", n)
        if types is None:
            raise ModelConfigError(f"{cfg.where}: missing 'compress_ratios' or 'layer_types'")
        rates = {**_RATES, **(cfg.get("compress_rates") or {})}
        ratios = [rates.get(t, 0) for t in types]
    if not isinstance(ratios, list) or len(ratios) < n:
        raise ModelConfigError(f"{cfg.where}: 'compress_ratios' needs one entry per layer")
    out = []
    for r in ratios[:n]:
        if isinstance(r, bool) or not isinstance(r, int) or r not in (0, 1, *_STATE_BLOCK):
            raise UnsupportedModel(
                f"compress ratio {r!r}: vLLM's DeepSeek-V4 compressor takes 4 and 128 only"
            )
        out.append(r)
    return out


def _deepseek_v4(config: dict[str, Any], arch: str) -> ModelShape:
    cfg = text_config(config, {})
    n = cfg.int("num_hidden_layers")
    head = cfg.int("head_dim", 512)
    if head != 512:
        raise UnsupportedModel(
            f"{arch} with head_dim {head}: FlashMLA's V4 kernels take 512 only"
        )
    window = cfg.int("sliding_window", 128)
    index_head = cfg.int("index_head_dim", 128)
    row, align = DSV4_FP8_DS_MLA_BYTES_PER_TOKEN, DSV4_FP8_DS_MLA_PAGE_ALIGNMENT
    swa = LayerKind(
        "sliding_window", sliding_window=window, bytes_per_token=row,
        block_size=_SWA_BLOCK, page_alignment=align,
    )
    index_key = LayerKind(
        "mla", bytes_per_token=index_head + index_head // _INDEXER_QUANT_BLOCK * 4,
        tokens_per_state=4, page_alignment=align,
    )

    def state(ratio: int, dim: int) -> LayerKind:
        coff = 2 if ratio == 4 else 1
        return LayerKind(
            "sliding_window", sliding_window=coff * ratio,
            bytes_per_token=2 * coff * dim * _FLOAT32, block_size=_STATE_BLOCK[ratio],
            page_alignment=align,
        )

    latents = {r: LayerKind("mla", bytes_per_token=row, tokens_per_state=r, page_alignment=align)
               for r in _STATE_BLOCK}
    states = {r: state(r, head) for r in _STATE_BLOCK}
    index_state = state(4, index_head)
    layers: list[LayerKind] = []
    positions: list[int] = []
    ratios = _ratios(cfg, n)
    for i, r in enumerate(ratios):
        if r == 4:
            layers += [index_key, index_state]
        layers.append(swa)
        if r > 1:
            layers += [latents[r], states[r]]
        positions += [i] * (len(layers) - len(positions))
    counts = {r: ratios.count(r) for r in (4, 128)}
    # MTP layers sit past num_hidden_layers: vLLM gives them compress ratio 1 (a
    # sliding-window latent only), whatever their compress_ratios entry says
    mtp = cfg.int("num_nextn_predict_layers", 0, minimum=0)
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=model_dtype(config, cfg.data),
        layers=tuple(layers),
        num_attention_heads=cfg.int("num_attention_heads"),
        num_kv_heads=1,
        head_size=head,
        head_size_v=0,
        mla_latent=head,
        sparse_mla=True,
        compressed_sparse_mla=True,
        mtp_layers=(swa,) * mtp,
        num_hidden_layers=n,
        layer_positions=tuple(positions),
        derived_max_model_len=derived_max_len(cfg),
        notes=(
            f"DeepSeek-V4: {n} sliding-window latents (window {window}), "
            f"{counts[4]} ratio-4 latents with an indexer, {counts[128]} ratio-128 "
            "latents, their float32 compressor states; fp8_ds_mla rows of "
            f"{row} B",
        ),
    )


ARCHITECTURES: dict[str, ShapeRule] = {
    "DeepseekV4ForCausalLM": _deepseek_v4,
}
