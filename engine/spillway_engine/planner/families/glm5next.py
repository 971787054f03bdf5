"""GLM-5 Next (``Glm5NextForCausalLM``, GLM-5.3-Flash): KDA linear attention beside
NoPE sparse MLA with a kpool-compressed indexer.

vLLM 0.33.0 (``vllm/models/glm5next/common``): layer i is a KDA layer when
``layer_types[i] == "linear_attention"`` (``Glm5NextLinearAttention``: a ``MambaSpec``
of q/k/v short convolutions and a float32 recurrent state, with one prefill checkpoint
block where FlashKDA runs), else an MLA layer whose ``Indexer`` registers, before the
latent, two caches:

* ``Glm5NextIndexerCache``: an ``MLAAttentionSpec`` of ``index_head_dim`` uint8 keys
  plus 4 bytes of scale per 128, one per ``index_kpool`` tokens
  (``tokens_per_state = index_kpool``); its backend's DeepGEMM pages are 32 or 64
  pooled entries (``kernel_block_tokens``, ``block_alignment``);
* ``Glm5NextTailCache``: a ``CircularBufferSpec`` ring of raw bf16 keys and gate scores
  (2 heads of ``index_head_dim``), ``index_kpool`` tokens plus the draft tokens rounded
  to a power of two of pools; its backend takes only the BLHNC layout, so vLLM packs
  every block's pages side by side.

The latent is ``kv_lora_rank`` wide (NoPE: ``qk_rope_head_dim`` 0).
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.shape import (
    ConfigReader,
    LayerKind,
    MambaState,
    ModelConfigError,
    ModelShape,
    ShapeRule,
    SparseMlaDims,
    UnsupportedModel,
    derived_max_len,
    divide_for_tp,
    model_dtype,
    text_config,
)

#: Indexer.quant_block_size: one 4-byte scale per 128 key elements
_INDEXER_QUANT_BLOCK = 128
#: deep_gemm.get_paged_mqa_page_sizes() off SM120: pooled entries per kernel page
_MQA_PAGES = (32, 64)
#: kda_prefill_checkpoint_alignment("flashkda")
_FLASHKDA_CHECKPOINT = 16


def _glm5next(config: dict[str, Any], arch: str) -> ModelShape:
    # Glm5NextTextConfig's own defaults for the KV-relevant fields (transformers)
    cfg = text_config(
        config,
        {
            "num_hidden_layers": 45,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 0,
            "index_topk": 2048,
            "index_head_dim": 128,
            "index_kpool": 16,
            "index_kpool_always_select_tail": True,
            "linear_head_dim": 128,
            "linear_num_heads": 64,
            "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0,
            "max_position_embeddings": 1048576,
        },
    )
    n = cfg.int("num_hidden_layers")
    if not cfg.has("index_topk"):
        raise UnsupportedModel(f"{arch} without a sparse indexer (index_topk) is not modelled")
    if cfg.get("index_kpool_always_select_tail") is not True:
        # _validate_supported_config
        raise UnsupportedModel(
            f"{arch}: vLLM refuses it (GLM-5.3 sparse indexer requires "
            "index_kpool_always_select_tail=True)"
        )
    if cfg.int("qk_rope_head_dim", minimum=0):
        raise UnsupportedModel(f"{arch} with a RoPE latent (qk_rope_head_dim > 0) is not modelled")
    kpool = cfg.int("index_kpool", minimum=2)  # Glm5NextIndexerCache asserts kpool > 1
    head = cfg.int("index_head_dim")
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:  # Glm5NextTextConfig: every fourth layer is MLA
        layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    kda = LayerKind("mamba")
    indexer, tail, mla = _mla_caches(kpool, head)
    layers: list[LayerKind] = []
    positions: list[int] = []
    for i, kind in enumerate(layer_types):
        caches = (kda,) if kind == "linear_attention" else (indexer, tail, mla)
        layers.extend(caches)
        positions.extend([i] * len(caches))
    # Glm5NextMTPModel (model_type glm5_next only): each MTP layer is an MLA decoder
    # layer (is_mtp_layer) with its own indexer keys, tail ring and latent
    mtp = cfg.int("num_nextn_predict_layers", 0, minimum=0)
    kda_state = _kda_state(cfg)
    latent = cfg.int("kv_lora_rank")
    if not layers:
        raise ModelConfigError(f"{cfg.where}: the model has no layers")
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=model_dtype(config, cfg.data),
        layers=tuple(layers),
        num_attention_heads=cfg.int("num_attention_heads", 64),
        num_kv_heads=1,
        head_size=latent,
        head_size_v=0,
        mla_latent=latent,
        sparse_mla=True,
        sparse_dims=_sparse_dims(cfg, latent, kpool),
        block_alignment=kpool * min(_MQA_PAGES),
        mamba=kda_state,
        mtp_layers=(indexer, tail, mla) * mtp,
        num_hidden_layers=n,
        layer_positions=tuple(positions),
        derived_max_model_len=derived_max_len(cfg),
        notes=(
            f"kpool indexer: one {indexer.bytes_per_token}-byte key per {kpool} tokens beside "
            f"each {latent}-wide NoPE latent; a circular tail ring per MLA layer, never "
            "offloaded (not prefix-cacheable)",
        ),
    )


def _sparse_dims(cfg: ConfigReader, latent: int, kpool: int) -> SparseMlaDims:
    """What the sparse backends check (a NoPE latent), and the GPU-dependent rules."""
    return SparseMlaDims(
        kv_lora_rank=latent,
        qk_rope_head_dim=0,
        qk_nope_head_dim=cfg.int("qk_nope_head_dim", 256),
        index_topk=cfg.int("index_topk"),
        # models/config.py Glm5NextModelConfig: an fp8 cache by default on SM10x
        sm10x_auto_kv_dtype="fp8",
        # DeepGEMM's paged MQA on SM120 takes only 64-entry pages
        sm12x_block_alignment=kpool * max(_MQA_PAGES),
    )


def _mla_caches(kpool: int, head: int) -> tuple[LayerKind, LayerKind, LayerKind]:
    """An MLA layer's three caches: the indexer's pooled keys, the tail ring, the latent."""
    indexer = LayerKind(
        "mla",
        bytes_per_token=head + head // _INDEXER_QUANT_BLOCK * 4,
        tokens_per_state=kpool,
        kernel_block_tokens=kpool * max(_MQA_PAGES),
    )
    tail = LayerKind("circular_buffer", bytes_per_token=2 * head * 2, ring_unit=kpool)
    return indexer, tail, LayerKind("mla")


def _kda_state(cfg: ConfigReader) -> MambaState:
    """The KDA layers' state per rank, and FlashKDA's prefill checkpoint."""
    heads, head_dim = cfg.int("linear_num_heads"), cfg.int("linear_head_dim")
    kernel = cfg.int("linear_conv_kernel_dim")
    bounded = cfg.get("linear_lower_bound") is not None

    def states(tp: int, dtype: str, num_spec: int) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.kda_state_shape / kda_state_dtype
        conv = divide_for_tp(3 * heads * head_dim, tp, "KDA conv dim")
        recurrent = divide_for_tp(heads, tp, "linear_num_heads")
        return [
            (conv * (kernel - 1 + num_spec), dtype),
            (recurrent * head_dim * head_dim, "float32"),
        ]

    def checkpoint(major: int, dtype: str) -> int | None:
        # _resolve_kda_prefill_backend: FlashKDA on SM90/10x/12x for bf16, head 128 and
        # a bounded gate (then a prefill checkpoint every 16 tokens), else Triton
        flash = major in (9, 10, 12) and head_dim == 128 and dtype == "bfloat16" and bounded
        return _FLASHKDA_CHECKPOINT if flash else None

    return MambaState("kda", states, checkpoint)


ARCHITECTURES: dict[str, ShapeRule] = {
    "Glm5NextForCausalLM": _glm5next,
}
