"""The records a KV-cache layout is made of: the deployment inputs that change it
(:class:`LayoutRequest`), one layer's cache spec (:class:`CacheSpec`), the groups vLLM
builds (:class:`KVGroup`), the whole layout (:class:`KVLayout`) and a pipeline stage's
share of it (:class:`Stage`). ``kv_layout.compute_layout`` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spillway_engine.planner.gpus import DEFAULT_CUDA_MAJOR, GdnKernel, Gpu
from spillway_engine.planner.shape import Kind, ModelShape


@dataclass(frozen=True)
class LayoutRequest:
    """Deployment inputs that change the layout."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    #: ``--speculative-config`` method: "mtp" (the model's own MTP heads), "draft_model"
    #: or "eagle3" (a separate drafter whose shape is ``drafter``)
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    #: the cache layers of a separate drafter (draft model or EAGLE-3 head), from its
    #: own config.json; ``None`` for MTP (the heads are in the model's config)
    drafter: ModelShape | None = None
    #: ``VLLM_PP_LAYER_PARTITION``: decoder layers per pipeline stage; None: vLLM's
    #: own split (``get_pp_indices``)
    pp_layer_partition: tuple[int, ...] | None = None
    #: the engine image's CUDA runtime major (Blackwell's GDN prefill kernel needs 13)
    cuda_major: int = DEFAULT_CUDA_MAJOR


@dataclass(frozen=True)
class CacheSpec:
    """One layer's cache spec on one rank (vLLM ``KVCacheSpec``), hashable for bucketing."""

    kind: Kind
    block_size: int
    page_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    per_token: int = 0  # attention bytes per token (0 for Mamba)
    #: tokens one stored state covers (compressed MLA, ``AttentionSpec.tokens_per_state``)
    tokens_per_state: int = 1
    #: the page before any alignment padding (0: the page itself)
    true_page_bytes: int = 0
    #: bytes the stride between blocks must be a multiple of in a block-outermost
    #: layout (``KVCacheSpec.get_block_stride_alignment``)
    stride_alignment: int = 1
    #: False for a per-request ring (``CircularBufferSpec``): no prefix caching, no offload
    prefix_cacheable: bool = True


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group as vLLM builds it, on one rank."""

    kind: Kind
    layer_indices: tuple[int, ...]
    tokens_per_block: int
    page_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    padded_layers: int = 0
    #: each layer's page when they differ (vLLM's ``UniformTypeKVCacheSpecs``: one
    #: attention type, other heads, e.g. a draft model's layers beside the target's);
    #: ``page_bytes`` is then their sum, the group spec's page
    layer_page_bytes: tuple[int, ...] = ()
    #: each layer's page without alignment padding, where pages are padded (DeepSeek-V4's
    #: fp8_ds_mla pages rounded up to 576 B); what an offloader copies
    layer_true_page_bytes: tuple[int, ...] = ()
    #: False for a circular-buffer ring: vLLM neither hashes nor offloads it
    prefix_cacheable: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of this group holds on one rank (its layers' pages)."""
        if self.layer_page_bytes:
            return self.page_bytes
        return self.page_bytes * self.num_layers


@dataclass(frozen=True)
class KVLayout:
    shape: ModelShape
    gpu: Gpu
    attention_backend: str | None
    kv_cache_dtype: str
    kv_dtype_bytes: int
    block_size: int
    mamba_cache_mode: Literal["align", "none"] | None
    mamba_page_bytes: int | None
    mamba_page_padded_bytes: int | None
    groups: tuple[KVGroup, ...]
    tokens_per_hash: int
    worker_bytes_per_block: int
    kv_heads_per_rank: int
    tp_replicas: int
    notes: tuple[str, ...] = field(default=())
    #: cache layers the drafter adds (the last ones of ``shape.layers``)
    draft_layers: int = 0
    #: block-outermost (BLHNC) KV layout: groups pack their layers' pages in each block
    block_outer: bool = False
    #: pipeline stages (empty without pipeline parallelism): each stage's workers hold
    #: the same groups with only the stage's layers
    stages: tuple[Stage, ...] = ()
    #: the GDN prefill kernel of a GDN hybrid (None: no GDN layers)
    gdn_prefill_kernel: GdnKernel | None = None

    @property
    def replicated_mla(self) -> bool:
        return self.shape.mla_latent > 0 and self.tp_replicas > 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its decoder layers, and the KV cache each of its TP workers
    holds (vLLM's global groups projected onto the stage's layers,
    ``_project_kv_cache_groups_to_worker``)."""

    index: int
    #: decoder layers ``[first_layer, end_layer)`` (``get_pp_indices``)
    first_layer: int
    end_layer: int
    #: the stage's cache layers, as indices among the whole model's (``shape.layers``)
    cache_layers: tuple[int, ...]
    #: the drafter's cache layers on this stage (vLLM builds the drafter on the last)
    draft_layers: int
    #: the layout one worker of this stage holds: every group of the model, each with
    #: only this stage's layers (a group may hold none), and the stage's bytes per block
    layout: KVLayout

