"""KV-cache layout: the KV-cache groups vLLM 0.33.0 builds for a model. THE one place.

From a model's shape (``planner/shape.py``, made from its config.json by the rule
of its family in ``planner/families/``) and the deployment (parallelism, dtypes, GPU,
prefix caching) this computes what vLLM's engine core computes at start-up with the
OffloadingConnector on (layer-outer ``LBHNC`` layout, hybrid KV cache manager on):

1. per-layer cache specs on one rank (``Attention``/``MLAAttention``/``MambaBase``
   ``get_kv_cache_spec``), with KV heads split over TP and replicated when TP exceeds
   them (``ModelConfig.get_num_kv_heads``: ``max(1, kv_heads // tp)``);
2. the block size (``Platform.update_block_size_for_backend``): the kernels' preferred
   size, then for attention+Mamba hybrids ``_align_hybrid_block_size`` (block raised
   until an attention page holds a Mamba state, Mamba page padded to match);
3. the groups (``kv_cache_planning.get_kv_cache_groups``): one group when every layer
   has the same spec, else page unification and buckets cut into ``group_size`` layers
   assigned ``layers[i::n]``;
4. the backing allocation's bytes per block per rank (the largest group) and
   ``tokens_per_hash`` (``resolve_kv_cache_block_sizes``).

It never imports vLLM; ``tests/contract`` checks it against vLLM's own code.
Unsupported architectures raise :class:`UnsupportedModel` naming what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from spillway_engine.arith import cdiv, round_up
from spillway_engine.planner.gpus import (
    DEFAULT_CUDA_MAJOR,
    FLASH_ATTN,
    FLASH_ATTN_SM90_FP8_HD512,
    FLASHINFER_MLA_SPARSE_SM90,
    FLASHMLA_SPARSE,
    FP8_DS_MLA_BYTES_PER_TOKEN,
    TRITON_ATTN,
    Backend,
    GdnKernel,
    Gpu,
    gdn_checkpoint_alignment,
)
from spillway_engine.planner.shape import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    Kind,
    LayerKind,
    ModelShape,
    UnsupportedModel,
)

# --------------------------------------------------------------------------- layout


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
class _Spec:
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


def _kv_dtype(shape: ModelShape, kv_cache_dtype: str) -> tuple[str, int]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"kv-cache dtype {kv_cache_dtype!r} is not modelled; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    resolved = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return resolved, DTYPE_BYTES[resolved]




def _backend(
    shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, block_size: int | None
) -> Backend | None:
    if not any(layer.kind != "mamba" for layer in shape.layers):
        return None
    if shape.sparse_mla:
        return gpu.sparse_mla_backend(
            kv_cache_dtype=kv_cache_dtype, head_size=shape.head_size, block_size=block_size
        )
    if shape.mla_latent:
        return gpu.mla_backend(
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, head_size=shape.head_size
        )
    if any(layer.head_size not in (None, shape.head_size) for layer in shape.layers):
        if gpu.compute_capability[0] == 10:
            raise UnsupportedModel(
                f"{shape.architecture} with per-layer head sizes on {gpu.name}: vLLM 0.33.0's "
                "Gemma4Config asks for FA4 there and lets FlashInfer take the layers it "
                "runs; that mix is not modelled yet; plan it for a Hopper pool"
            )
        if gpu.generation != "hopper":
            # Gemma4Config: FA4 does not run on SM8x/SM12x, so it forces Triton
            return TRITON_ATTN
        # Gemma4Config on SM90: FA4 (shipped with vLLM's FlashAttention) for every layer,
        # MultipleOf(16) pages (its 128-token hd256 pages are SM100 only)...
        if kv_cache_dtype in ("auto", "bfloat16", "float16"):
            return FLASH_ATTN
        # ...but with an FP8 cache FA3 on the head-256 layers and FA4 (exactly 64-token
        # FP8 pages) on the head-512 ones; the model's largest head makes 64 preferred.
        heads = {shape.head_size} | {layer.head_size for layer in shape.layers} - {None}
        if max(heads) != 512 or any(
            layer.kind == "sliding_window" and layer.head_size == 512 for layer in shape.layers
        ):
            raise UnsupportedModel(
                f"{shape.architecture} with head sizes {sorted(heads)} (sliding layers "
                f"{'with' if max(heads) == 512 else 'without'} head 512) and an FP8 KV cache "
                f"on {gpu.name}: only FA4's head-512 FP8 pages on full layers are modelled"
            )
        if block_size is not None and not FLASH_ATTN_SM90_FP8_HD512.blocks.accepts(block_size):
            raise UnsupportedModel(
                f"--block-size {block_size} with {shape.architecture}'s head-512 layers and "
                f"an FP8 KV cache on {gpu.name}: FlashAttention takes only multiples of 64 "
                "there (FA4's 64-token FP8 pages), so vLLM's selector falls back to another "
                "backend, which is not modelled; use a multiple of 64 or no --block-size"
            )
        return FLASH_ATTN_SM90_FP8_HD512
    return gpu.attention_backend(
        mm_prefix=shape.mm_prefix,
        kv_cache_dtype=kv_cache_dtype,
        sinks=shape.sinks,
        head_size=shape.head_size,
    )


def compute_layout(shape: ModelShape, gpu: Gpu, request: LayoutRequest) -> KVLayout:
    """The KV-cache groups, hash unit and bytes per block vLLM 0.33.0 builds."""
    tp = request.tensor_parallel_size
    if tp < 1 or request.pipeline_parallel_size < 1:
        raise ValueError("parallel sizes must be at least 1")
    if request.pipeline_parallel_size > 1:
        if shape.pipeline_refusal:
            raise UnsupportedModel(shape.pipeline_refusal)
        if request.speculative_method not in (None, "mtp"):
            raise UnsupportedModel(
                f"a {request.speculative_method} drafter with pipeline parallelism is not "
                "modelled (vLLM builds it on the last stage with its own layer split); the "
                "model's own MTP layers (method=mtp) are"
            )
    elif request.pp_layer_partition is not None:
        raise UnsupportedModel(
            "pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) is given without pipeline "
            "parallelism (pipeline_parallel_size 1)"
        )
    if request.dtype != "auto":
        if request.dtype not in ("bfloat16", "float16"):
            raise UnsupportedModel(
                f"dtype {request.dtype!r} is not modelled (auto, bfloat16, float16)"
            )
        shape = replace(shape, dtype=request.dtype)
    if shape.num_attention_heads % tp:
        raise UnsupportedModel(
            f"the {shape.num_attention_heads} attention heads are not divisible by TP {tp}; "
            "vLLM refuses this tensor-parallel size"
        )
    kv_dtype, kv_bytes = _kv_dtype(shape, request.kv_cache_dtype)
    notes = list(shape.notes)
    if shape.compressed_sparse_mla:
        return _packed_layout(shape, gpu, request, notes)
    # The target's layers pick the backend and block size (update_block_size_for_backend
    # reads the model config); a drafter selects its own backend for its layers.
    backend = _backend(shape, gpu, request.kv_cache_dtype, request.block_size)
    own_layers = len(shape.layers)
    if request.speculative_method == "mtp" and shape.model_type == "glm5_next_text":
        # SpeculativeConfig maps only model_type glm5_next to its MTP drafter
        raise UnsupportedModel(
            f"--speculative-config method=mtp with {shape.architecture} of model_type "
            "glm5_next_text: vLLM 0.33.0 refuses it (Unsupported speculative method: 'mtp')"
        )
    if request.speculative_method not in (None, "mtp") and any(
        x.kind == "circular_buffer" for x in shape.layers
    ):
        raise UnsupportedModel(
            f"speculative decoding with {shape.architecture} and a separate drafter is not "
            "modelled (its layers beside the packed ring and KDA groups); its own MTP "
            "layers (method=mtp) are"
        )
    shape, num_spec = _with_drafter(shape, request, notes)

    # Per-token attention page on one rank (AttentionSpec with block_size 1).
    kv_heads = 1 if shape.mla_latent else max(1, shape.num_kv_heads // tp)
    if not shape.mla_latent and shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise UnsupportedModel(f"{shape.num_kv_heads} KV heads cannot be split evenly over TP {tp}")
    if not shape.mla_latent and tp > shape.num_kv_heads:
        notes.append(
            f"TP {tp} exceeds the {shape.num_kv_heads} KV heads: each rank stores a full "
            "replicated head"
        )
    per_token = kv_heads * (shape.head_size + shape.head_size_v) * kv_bytes
    if backend is FLASHMLA_SPARSE and kv_dtype in ("fp8", "fp8_e4m3"):
        per_token = FP8_DS_MLA_BYTES_PER_TOKEN  # FlashMLA's sparse fp8_ds_mla format
    if backend is FLASHINFER_MLA_SPARSE_SM90:
        notes.append(
            "FLASHINFER_MLA_SPARSE_SM90 serves the fp8 latents: vLLM needs FlashInfer's "
            "kernels (flashinfer-cubin, or nvcc and ninja) for it, else it finds no backend"
        )

    def layer_per_token(layer: LayerKind) -> int:
        """Attention bytes per token of a layer with its own heads (else the model's)."""
        if layer.bytes_per_token is not None:
            return layer.bytes_per_token
        if layer.num_kv_heads is None and layer.head_size is None:
            return per_token
        heads = shape.num_kv_heads if layer.num_kv_heads is None else layer.num_kv_heads
        if heads % tp and tp % heads:
            raise UnsupportedModel(f"{heads} KV heads cannot be split evenly over TP {tp}")
        size = shape.head_size if layer.head_size is None else layer.head_size
        return max(1, heads // tp) * 2 * size * kv_bytes

    # Phase 1: the kernels' preferred block size, unless forced.
    if request.block_size is not None:
        if request.block_size < 1:
            raise ValueError("block size must be positive")
        if backend is not None and not backend.blocks.accepts(request.block_size):
            raise UnsupportedModel(
                f"block size {request.block_size} is not supported by the "
                f"{backend.name} attention backend vLLM picks on {gpu.name}"
            )
        block = request.block_size
    else:
        block = backend.blocks.preferred() if backend is not None else 16

    gdn_kernel: GdnKernel | None = (
        gpu.gdn_prefill_kernel(shape.gdn_head_k_dim, request.cuda_major) if shape.gdn else None
    )
    # Phase 2: attention+Mamba hybrids (Platform._align_hybrid_block_size).
    mamba_mode: Literal["align", "none"] | None = None
    mamba_page = mamba_padded = None
    mamba_block = 0
    if shape.mamba is not None:
        if backend is None:
            raise UnsupportedModel("attention-free Mamba models are not modelled")
        mamba_mode = "align" if request.enable_prefix_caching else "none"
        mamba_page = shape.mamba.page_bytes(tp, shape.dtype, num_spec)
        align = max(backend.blocks.base, block)
        if shape.mla_latent:
            align = max(align, 128)  # MLA decode kernels need 128-aligned block counts
        gdn_grid = gdn_checkpoint_alignment(gdn_kernel)
        if mamba_mode == "align" and gdn_grid:
            align = math.lcm(align, gdn_grid)
        checkpoint = shape.mamba.checkpoint_alignment
        checkpoint = checkpoint and checkpoint(gpu.compute_capability[0], shape.dtype)
        if mamba_mode == "align" and checkpoint:
            # only the spec carries it (num_prefill_checkpoint_blocks): the layer declares
            # no get_prefill_checkpoint_alignment, so the block is not aligned to it
            notes.append(
                f"{shape.mamba.family} prefill checkpoints every {checkpoint} tokens (one "
                "more state block per request)"
            )
        attn_block = align * cdiv(mamba_page, align * per_token)
        # a multiple of every attention backend's smallest kernel block
        base = math.lcm(backend.blocks.base, shape.block_alignment)
        attn_block = base * cdiv(attn_block, base)
        if block < attn_block:
            block = attn_block
            notes.append(
                f"block size raised to {block} tokens so an attention page holds a "
                f"{shape.mamba.family} state"
            )
        if not backend.blocks.accepts(block):
            raise UnsupportedModel(f"aligned block size {block} is not supported by {backend.name}")
        if block * per_token != mamba_page:
            mamba_padded = block * per_token
        if mamba_mode == "align":
            mamba_block = block
        else:
            if request.max_model_len is None:
                raise ValueError("max_model_len is needed without prefix caching")
            mamba_block = request.max_model_len

    elif shape.block_alignment > 1:
        raise UnsupportedModel(
            f"{shape.architecture} without linear-attention layers is not modelled"
        )

    specs: list[_Spec] = []
    # One _Spec per LayerKind object (the family rules share one per kind of layer):
    # grouping then buckets by identity instead of hashing each layer's dataclass.
    made: dict[int, _Spec] = {}
    for layer in shape.layers:
        spec = made.get(id(layer))
        if spec is None:
            spec = made[id(layer)] = _layer_spec(
                layer, shape, block, mamba_block, mamba_page, mamba_padded, layer_per_token,
                num_spec,
            )
        specs.append(spec)

    # A circular-buffer ring's backend (the kpool tail's) takes only BLHNC, which
    # vLLM then uses instead of the offloading connector's LBHNC.
    block_outer = any(s.kind == "circular_buffer" for s in made.values())
    if block_outer:
        groups = _packed_groups(specs)
        notes.append(
            f"block-outermost KV layout (BLHNC): {len(groups)} groups pack their layers' "
            "pages side by side in each block"
        )
        # _get_kv_cache_bytes_per_block: the widest group, to every stride alignment
        stride = math.lcm(*(s.stride_alignment for s in made.values()))
        worker_bytes = round_up(max(g.bytes_per_block for g in groups), stride)
    else:
        if any(s.tokens_per_state > 1 for s in made.values()):
            raise UnsupportedModel("compressed caches on a layer-outer KV layout are not modelled")
        groups = _group(specs, notes)
        # Padding layers own no memory: a block costs the largest real group.
        worker_bytes = max(g.bytes_per_block for g in groups)
    tokens_per_hash = _tokens_per_hash(groups, mamba_mode)
    # MLA latents are identical on every TP rank (max_tp_shards = 1); Mamba states are
    # split over TP, so a hybrid's ranks do not hold identical caches (the gcd is 1).
    tp_replicas = tp if shape.mla_latent and shape.mamba is None else 1
    layout = KVLayout(
        shape=shape,
        gpu=gpu,
        attention_backend=backend.name if backend else None,
        kv_cache_dtype=kv_dtype,
        kv_dtype_bytes=kv_bytes,
        block_size=block,
        mamba_cache_mode=mamba_mode,
        mamba_page_bytes=mamba_page,
        mamba_page_padded_bytes=mamba_padded,
        groups=groups,
        tokens_per_hash=tokens_per_hash,
        worker_bytes_per_block=worker_bytes,
        kv_heads_per_rank=kv_heads,
        tp_replicas=tp_replicas,
        notes=tuple(notes),
        draft_layers=len(shape.layers) - own_layers,
        block_outer=block_outer,
        gdn_prefill_kernel=gdn_kernel,
    )
    return _with_stages(layout, own_layers, specs, request)


# ------------------------------------------------- compressed caches, packed blocks


def compressed_page_bytes(
    block_size: int, bytes_per_state: int, tokens_per_state: int = 1, alignment: int | None = None
) -> tuple[int, int]:
    """(page, unpadded page) of one layer of a one-head cache with its own state format.

    vLLM's ``AttentionSpec``: ``block_size // tokens_per_state`` states a block (a
    compressed MLA cache keeps one state per ``tokens_per_state`` tokens), each
    ``bytes_per_state`` (``state_content_bytes``); MLA specs with an ``alignment``
    round the page up to it (``_apply_alignment_padding``).
    """
    if tokens_per_state < 1 or block_size % tokens_per_state:
        raise UnsupportedModel(
            f"a {block_size}-token block does not hold whole states of {tokens_per_state} "
            "tokens"
        )
    raw = block_size // tokens_per_state * bytes_per_state
    return (round_up(raw, alignment) if alignment else raw), raw


def _state_spec(layer: LayerKind, block: int) -> _Spec:
    """A layer with its own state format (``bytes_per_token`` per state)."""
    assert layer.bytes_per_token is not None
    own = layer.block_size or block
    page, raw = compressed_page_bytes(
        own, layer.bytes_per_token, layer.tokens_per_state, layer.page_alignment
    )
    return _Spec(
        layer.kind,
        own,
        page,
        layer.sliding_window,
        tokens_per_state=layer.tokens_per_state,
        true_page_bytes=raw,
    )


def _packed_layout(
    shape: ModelShape, gpu: Gpu, request: LayoutRequest, notes: list[str]
) -> KVLayout:
    """DeepSeek-V4: every cache is a one-head MLA-format spec with its own block size,
    packed side by side in block-outermost blocks (its indexer's backend declares only
    BLHNC/BLNHC, so vLLM overrides the offloading connector's LBHNC)."""
    backend = gpu.compressed_sparse_mla_backend(kv_cache_dtype=request.kv_cache_dtype)
    method = request.speculative_method
    if method not in (None, "mtp"):
        raise UnsupportedModel(
            f"speculative decoding with {shape.architecture} and a separate drafter is not "
            "modelled (its layers beside the packed groups); its own MTP layers "
            "(method=mtp) are"
        )
    if method == "mtp" and shape.model_type == "deepseek_v41":
        raise UnsupportedModel(
            f"--speculative-config method=mtp with {shape.architecture} of model_type "
            "deepseek_v41: vLLM 0.33.0 refuses it (DeepSeek V4.1 has no classic-MTP draft; "
            "use speculative method 'dspark')"
        )
    own_layers = len(shape.layers)
    # DeepSeekV4MTP: each MTP layer is a decoder layer past num_hidden_layers, so its
    # compress ratio is 1: one sliding-window latent, whatever the draft tokens
    shape, _ = _with_drafter(shape, request, notes)
    block = backend.blocks.preferred()
    if request.block_size is not None and request.block_size != block:
        raise UnsupportedModel(
            f"--block-size {request.block_size} with {shape.architecture}: only "
            f"{backend.name}'s own {block}-token pages are modelled (other multiples change "
            "the compressed pages' block-stride alignment)"
        )
    made: dict[int, _Spec] = {}
    specs = []
    for layer in shape.layers:
        spec = made.get(id(layer))
        if spec is None:
            spec = made[id(layer)] = _state_spec(layer, block)
        specs.append(spec)
    groups = _packed_groups(specs)
    notes.append(
        f"block-outermost KV layout (BLHNC): {len(groups)} groups pack their layers' pages "
        "side by side in each block"
    )
    if len({g.tokens_per_block for g in groups}) > 1:
        # offload_geometry.spillway_connector_refusal: the plan refuses offloader=spillway
        notes.append(
            "Spillway's connector cannot re-cut packed groups (UniformTypeKVCacheSpecs) "
            "coarser than the finest block (it refuses to start): only vLLM's offloader "
            "runs this model"
        )
    layout = KVLayout(
        shape=shape,
        gpu=gpu,
        attention_backend=backend.name,
        kv_cache_dtype="fp8_ds_mla",
        kv_dtype_bytes=1,
        block_size=block,
        mamba_cache_mode=None,
        mamba_page_bytes=None,
        mamba_page_padded_bytes=None,
        groups=groups,
        tokens_per_hash=_tokens_per_hash(groups, None),
        # block-outermost: a block is as wide as the widest group (block strides
        # align to 1 at the kernels' own block size)
        worker_bytes_per_block=max(g.bytes_per_block for g in groups),
        kv_heads_per_rank=1,
        # every cache is a replicated latent or state (max_tp_shards = 1)
        tp_replicas=request.tensor_parallel_size,
        notes=tuple(notes),
        draft_layers=len(shape.layers) - own_layers,
        block_outer=True,
    )
    return _with_stages(layout, own_layers, specs, request)


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's ``_approximate_gcd``: the divisor in [lower_bound, max] that pads least
    (ties: the larger)."""
    low, high = max(1, lower_bound), max(values)
    if low > high:
        return low
    best = low
    best_pad: int | None = None
    for d in range(low, high + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _packed_groups(specs: list[_Spec]) -> tuple[KVGroup, ...]:
    """``_get_packed_kv_cache_groups``: layers bucketed by uniform type (kind, block,
    window); a bucket whose page sizes repeat one layer each is a layer pattern, split
    into groups of the same number of repeats; every group holds each layer's page."""
    if len({s.page_bytes for s in _distinct(specs)}) <= 1:
        raise UnsupportedModel("packed block-outermost groups with one page size are not modelled")
    buckets: dict[tuple[object, ...], list[int]] = {}
    for index, s in enumerate(specs):
        base = "full" if s.kind in ("full_attention", "mla") else s.kind
        key = (base, s.block_size, s.sliding_window, s.attention_chunk_size)
        buckets.setdefault(key, []).append(index)
    described = []
    for layers in buckets.values():
        by_page: dict[int, list[int]] = {}
        for i in layers:
            by_page.setdefault(specs[i].page_bytes, []).append(i)
        counts = [len(v) for v in by_page.values()]
        described.append((layers, by_page, len(set(counts)) == 1, max(counts)))
    floor = max((most for _, pages, even, most in described if even and len(pages) > 1), default=0)
    repeats = (
        _approximate_gcd([most for _, _, even, most in described if even], floor)
        if floor
        else None
    )
    if repeats is None and any(specs[b[0]].kind == "sliding_window" for b, *_ in described):
        raise UnsupportedModel(
            "packed sliding-window state buckets without a layer pattern are not modelled"
        )
    def split(even: bool, most: int) -> int:
        return cdiv(most, repeats) if even and repeats is not None else 1

    # Mamba and ring buckets ("state buckets") may split down to one layer a group, so
    # the block is as wide as the widest other group; they then split to fit it.
    def state(layers: list[int]) -> bool:
        return specs[layers[0]].kind in ("mamba", "circular_buffer")

    anchor = max(
        sum(cdiv(len(v), len(layers) if state(layers) else split(even, most)) * page
            for page, v in by_page.items())
        for layers, by_page, even, most in described
    )
    groups: list[KVGroup] = []
    for layers, by_page, even, most in described:
        n = split(even, most)
        if state(layers):
            fit = max(anchor // specs[layers[0]].page_bytes, 1)
            n = max(n, cdiv(len(layers), fit))
        if n == 1:
            parts = [layers]
        else:
            pattern = list(zip(*by_page.values(), strict=False))
            parts = [[i for repeat in pattern[g::n] for i in repeat] for g in range(n)]
            if sum(map(len, parts)) != len(layers):
                raise UnsupportedModel("an uneven packed layer pattern is not modelled")
        for members in parts:
            first = specs[members[0]]
            pages = tuple(specs[i].page_bytes for i in members)
            groups.append(
                KVGroup(
                    first.kind,
                    tuple(members),
                    first.block_size,
                    sum(pages),
                    first.sliding_window,
                    first.attention_chunk_size,
                    layer_page_bytes=pages,
                    layer_true_page_bytes=tuple(
                        specs[i].true_page_bytes or specs[i].page_bytes for i in members
                    ),
                    prefix_cacheable=first.prefix_cacheable,
                )
            )
    return tuple(groups)


#: --speculative-config methods whose drafter the planner models
SPECULATIVE_METHODS = ("mtp", "draft_model", "eagle3")


def _with_drafter(
    shape: ModelShape, request: LayoutRequest, notes: list[str]
) -> tuple[ModelShape, int]:
    """The shape with the drafter's cache layers appended, and the draft tokens per step.

    vLLM's proposer builds the drafter into the same forward context after the target
    (its layers come last): each draft layer gets a spec from its own heads (``is_draft``
    does not take part in grouping), so a draft layer with the target's spec joins the
    target's group and one with other heads makes a one-type group of mixed pages;
    Mamba convolution states keep ``num_speculative_tokens`` more rows.
    """
    method = request.speculative_method
    if method is None:
        return shape, 0
    if method not in SPECULATIVE_METHODS:
        raise UnsupportedModel(
            f"speculative method {method!r} is not modelled (mtp: the model's own MTP "
            "heads; draft_model and eagle3 with the drafter's config.json)"
        )
    if request.num_speculative_tokens < 1:
        raise UnsupportedModel("num_speculative_tokens must be at least 1 with a drafter")
    if method == "mtp":
        if not shape.mtp_layers:
            raise UnsupportedModel(
                f"{shape.architecture}: the config has no MTP layers (num_nextn_predict_layers "
                "/ mtp_num_hidden_layers) for --speculative-config method=mtp"
            )
        drafted = shape.mtp_layers
        what = "MTP drafter"
    else:
        drafted = _drafter_layers(shape, request)
        what = f"{method} drafter ({request.drafter.architecture})"  # type: ignore[union-attr]
    notes.append(
        f"{what}: {len(drafted)} cache layer(s) appended after the model's "
        f"{len(shape.layers)}, {request.num_speculative_tokens} draft token(s) per step"
    )
    return replace(shape, layers=shape.layers + drafted), request.num_speculative_tokens


def _drafter_layers(shape: ModelShape, request: LayoutRequest) -> tuple[LayerKind, ...]:
    """A separate drafter's cache layers with its own heads (the KV dtype is the
    target's: vLLM builds the draft's ModelConfig with the target's dtype)."""
    draft = request.drafter
    method = request.speculative_method
    if draft is None:
        raise UnsupportedModel(
            f"--speculative-config method {method!r} needs the drafter's config.json (its "
            "'model'); a drafter the planner cannot see is not modelled"
        )
    tp = request.tensor_parallel_size
    if draft.mla_latent or draft.mamba is not None:
        raise UnsupportedModel(
            f"a {method} drafter with MLA or Mamba layers ({draft.architecture}) is not modelled"
        )
    if shape.mla_latent or shape.mamba is not None:
        raise UnsupportedModel(
            f"a {method} drafter beside {shape.architecture}'s "
            f"{'MLA' if shape.mla_latent else 'Mamba'} layers is not modelled (only "
            "attention targets)"
        )
    # EngineArgs sets CacheConfig.sliding_window for an all-sliding target; a draft layer
    # without a window of its own takes it (Attention's fallback), so it slides alike.
    windows = {layer.sliding_window for layer in shape.layers}
    target_window = None
    if all(layer.kind == "sliding_window" for layer in shape.layers) and len(windows) == 1:
        target_window = windows.pop()
    if any(layer.kind not in ("full_attention", "sliding_window") for layer in draft.layers):
        raise UnsupportedModel(f"a {method} drafter with chunked-local layers is not modelled")
    mixed = len({layer.kind for layer in shape.layers}) > 1
    if draft.num_attention_heads % tp:
        # ModelConfig.verify_with_parallel_config on the draft's config
        raise UnsupportedModel(
            f"the drafter's {draft.num_attention_heads} attention heads are not divisible "
            f"by TP {tp}: vLLM refuses it (Total number of attention heads "
            f"({draft.num_attention_heads}) must be divisible by tensor parallel size ({tp}))"
        )
    if draft.num_kv_heads % tp and tp % draft.num_kv_heads:
        raise UnsupportedModel(
            f"the drafter's {draft.num_kv_heads} KV heads cannot be split evenly over TP {tp}"
        )
    if draft.head_size != draft.head_size_v:
        raise UnsupportedModel("a drafter with different K and V head sizes is not modelled")
    same = (draft.num_kv_heads, draft.head_size) == (shape.num_kv_heads, shape.head_size)
    if mixed and not same:
        # other pages beside several attention kinds regroup the target's layers (block
        # sizes unified, buckets split, the hash unit: vLLM #48919); unchecked, so refused
        raise UnsupportedModel(
            f"a {method} drafter with other KV heads than {shape.architecture}'s, beside its "
            "mix of attention kinds, is not modelled (vLLM #48919); a drafter with the "
            "target's heads is"
        )
    if any(layer.kind not in ("full_attention", "sliding_window") for layer in shape.layers):
        raise UnsupportedModel(
            f"a {method} drafter beside {shape.architecture}'s chunked-local layers is not "
            "modelled"
        )
    heads = {} if same else {"num_kv_heads": draft.num_kv_heads, "head_size": draft.head_size}
    made: dict[int | None, LayerKind] = {}
    out = []
    for layer in draft.layers:
        window = layer.sliding_window if layer.kind == "sliding_window" else target_window
        if window not in made:
            kind = "full_attention" if window is None else "sliding_window"
            made[window] = LayerKind(kind, window, **heads)
        out.append(made[window])
    return tuple(out)


def _layer_spec(
    layer: LayerKind,
    shape: ModelShape,
    block: int,
    mamba_block: int,
    mamba_page: int | None,
    mamba_padded: int | None,
    layer_per_token: Callable[[LayerKind], int],
    num_spec: int = 0,
) -> _Spec:
    """One layer's spec on one rank (``get_kv_cache_spec``)."""
    if layer.kind == "mamba":
        assert mamba_page is not None
        return _Spec("mamba", mamba_block, mamba_padded or mamba_page)
    if layer.kind == "sliding_window" and shape.mla_latent:
        raise UnsupportedModel("sliding-window MLA is not modelled")
    if layer.kind == "circular_buffer":
        return _ring_spec(layer, block, num_spec)
    if layer.tokens_per_state > 1:
        return _kernel_strided(_state_spec(layer, block), layer)
    layer_token = layer_per_token(layer)
    if shape.sparse_mla and layer.kind == "mla" and layer.bytes_per_token is None:
        # FlashAttention's / FlashMLA's 16-bit sparse kernels read flat rows
        # (align_blocks_to_rows); FlashMLA's fp8_ds_mla pages are not modelled here
        return _Spec(layer.kind, block, block * layer_token, per_token=layer_token,
                     stride_alignment=layer_token)
    return _Spec(
        layer.kind,
        block,
        block * layer_token,
        layer.sliding_window,
        layer.attention_chunk_size,
        layer_token,
    )


def _ring_spec(layer: LayerKind, block: int, num_spec: int) -> _Spec:
    """``Glm5NextTailCache``: one ring of raw keys per request (``CircularBufferSpec``),
    a pool plus the draft tokens rounded to a power of two of pools; never hashed."""
    unit, per_token = layer.ring_unit, layer.bytes_per_token
    assert unit is not None and per_token is not None
    ring = unit * (1 << (cdiv(unit + num_spec, unit) - 1).bit_length())
    if block % ring:
        raise UnsupportedModel(
            f"block size {block} is not a multiple of the {ring}-token tail ring; vLLM "
            f"asserts (Glm5NextTailCache: cache_config.block_size ({block}) must be a "
            f"multiple of the tail ring ({ring}))"
        )
    return _Spec("circular_buffer", ring, ring * per_token, prefix_cacheable=False)


def _kernel_strided(spec: _Spec, layer: LayerKind) -> _Spec:
    """``get_block_stride_alignment`` of a ``MultipleOf(kernel_block_tokens)`` spec: a
    block split into kernel pages keeps whole pages apart (one page if it is one)."""
    if layer.kernel_block_tokens is None:
        return spec
    kernel = math.gcd(layer.kernel_block_tokens, spec.block_size)
    if kernel == spec.block_size:
        return spec
    assert layer.bytes_per_token is not None
    page, _ = compressed_page_bytes(
        kernel, layer.bytes_per_token, layer.tokens_per_state, layer.page_alignment
    )
    return replace(spec, stride_alignment=page)


def _distinct(specs: list[_Spec]) -> list[_Spec]:
    """The distinct spec objects, in order of first use (equal ones may repeat)."""
    return list({id(s): s for s in specs}.values())


def _unify_pages(specs: list[_Spec], distinct: list[_Spec]) -> list[_Spec]:
    """``unify_kv_cache_spec_page_size``: grow smaller attention blocks, else pad."""
    unified = dict(zip(map(id, distinct), _unify_distinct(distinct), strict=True))
    return [unified[id(s)] for s in specs]


def _unify_distinct(specs: list[_Spec]) -> list[_Spec]:
    largest = max(s.page_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_bytes == largest:
            out.append(s)
        elif s.kind != "mamba" and largest % s.page_bytes == 0:
            ratio = largest // s.page_bytes
            out.append(replace(s, block_size=s.block_size * ratio, page_bytes=largest))
        elif s.kind != "mla":  # Mamba and non-MLA attention pages are padded
            out.append(replace(s, page_bytes=largest))
        else:
            raise UnsupportedModel(
                "MLA pages that do not divide the largest page cannot be unified"
            )
    return out


def _group(specs: list[_Spec], notes: list[str]) -> tuple[KVGroup, ...]:
    """``get_kv_cache_groups`` for the layer-outer (LBHNC) layout."""
    distinct = _distinct(specs)
    if len(set(distinct)) == 1:
        s = specs[0]
        return (
            KVGroup(
                s.kind,
                tuple(range(len(specs))),
                s.block_size,
                s.page_bytes,
                s.sliding_window,
                s.attention_chunk_size,
            ),
        )
    if (
        len({(s.kind, s.block_size, s.sliding_window, s.attention_chunk_size)
             for s in distinct})
        == 1
    ):
        # UniformTypeKVCacheSpecs: one group whose layers' pages differ; its spec's
        # page is their sum, and a block holds each layer's own page.
        s = specs[0]
        if s.kind == "mamba":  # MLA: sparse latents beside indexer keys (DeepSeek-V3.2)
            raise UnsupportedModel(f"{s.kind} layers with different page sizes are not modelled")
        pages = tuple(spec.page_bytes for spec in specs)
        notes.append(
            f"one {s.kind} group of {len(specs)} layers with {len(set(pages))} page sizes "
            "(vLLM's UniformTypeKVCacheSpecs)"
        )
        return (
            KVGroup(
                s.kind,
                tuple(range(len(specs))),
                s.block_size,
                sum(pages),
                s.sliding_window,
                s.attention_chunk_size,
                layer_page_bytes=pages,
            ),
        )
    unified = _unify_pages(specs, distinct)
    # Layers by spec object, then objects merged by value (order of first use kept).
    by_object: dict[int, tuple[_Spec, list[int]]] = {}
    for index, spec in enumerate(unified):
        entry = by_object.get(id(spec))
        if entry is None:
            by_object[id(spec)] = (spec, [index])
        else:
            entry[1].append(index)
    buckets: dict[_Spec, list[int]] = {}
    for spec, layers in by_object.values():
        merged = buckets.setdefault(spec, [])
        if merged:
            merged.extend(layers)
            merged.sort()
        else:
            merged.extend(layers)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups: list[KVGroup] = []
    for spec, layers in buckets.items():
        num_groups = cdiv(len(layers), group_size)
        padding = num_groups * group_size - len(layers)
        if padding:
            notes.append(
                f"vLLM adds {padding} padding layer(s) to the {spec.kind} layers "
                f"(group size {group_size})"
            )
        for i in range(num_groups):
            members = tuple(layers[i::num_groups])
            groups.append(
                KVGroup(
                    spec.kind,
                    members,
                    spec.block_size,
                    spec.page_bytes,
                    spec.sliding_window,
                    spec.attention_chunk_size,
                    padded_layers=group_size - len(members),
                )
            )
    return tuple(groups)


def _tokens_per_hash(groups: tuple[KVGroup, ...], mamba_mode: str | None) -> int:
    """``resolve_kv_cache_block_sizes`` with a KV connector on (offloading)."""
    sizes = [g.tokens_per_block for g in groups]
    if len(groups) == 1:
        return sizes[0]
    if mamba_mode == "none":
        return math.lcm(*sizes)  # Mamba outside align mode: hash at the scheduler block
    # a circular-buffer ring is never hashed
    return math.gcd(*([g.tokens_per_block for g in groups if g.prefix_cacheable] or sizes))


# ------------------------------------------------------------ pipeline parallelism


def parse_pp_layer_partition(text: str) -> tuple[int, ...]:
    """``VLLM_PP_LAYER_PARTITION`` as vLLM reads it: comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UnsupportedModel(
            f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {text!r} is not a "
            f"comma-separated list of integers; vLLM refuses it (Invalid partition string: "
            f"{text})"
        ) from None


def pp_partition(
    num_hidden_layers: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Decoder layers per stage as vLLM 0.33.0's ``get_pp_indices`` splits them.

    With ``partition`` (``VLLM_PP_LAYER_PARTITION``) it must have one entry per stage
    summing to the layer count. Without, an even split whose remainder goes one layer
    each to the stages before the last, from the second-to-last backwards."""
    if pp_size < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if partition is not None:
        partitions = list(partition)
        if len(partitions) != pp_size:
            raise UnsupportedModel(
                f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) has {len(partitions)} "
                f"entries for pipeline_parallel_size {pp_size}; vLLM refuses it "
                f"(len(partitions)={len(partitions)} does not match pp_size={pp_size}.)"
            )
        if sum(partitions) != num_hidden_layers:
            raise UnsupportedModel(
                f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {partitions} sums to "
                f"{sum(partitions)}, not the model's {num_hidden_layers} decoder layers "
                f"(num_hidden_layers); vLLM refuses it (sum(partitions)={sum(partitions)} "
                f"does not match num_hidden_layers={num_hidden_layers}.)"
            )
        return tuple(partitions)
    partitions = [num_hidden_layers // pp_size] * pp_size
    for i in range(2, num_hidden_layers % pp_size + 2):
        partitions[-i] += 1
    return tuple(partitions)


def pp_indices(
    num_hidden_layers: int,
    pp_rank: int,
    pp_size: int,
    partition: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """``get_pp_indices``: stage ``pp_rank``'s decoder layers ``[start, end)``."""
    partitions = pp_partition(num_hidden_layers, pp_size, partition)
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def _with_stages(
    layout: KVLayout, own_layers: int, specs: list[_Spec], request: LayoutRequest
) -> KVLayout:
    """The layout with its pipeline stages (none without pipeline parallelism).

    vLLM groups the whole model's layers once (``get_global_kv_cache_groups`` over
    every worker's specs merged: the same groups as without PP), then each worker keeps
    every group with only its own layers (``_project_kv_cache_groups_to_worker``; a
    group may keep none) and sizes its backing allocation from them: a block costs the
    stage's largest group. The hash unit and block sizes are the model's. Decoder
    layers split as ``get_pp_indices`` says; the drafter sits on the last stage.
    """
    pp = request.pipeline_parallel_size
    if pp == 1:
        return layout
    shape = layout.shape
    hidden = shape.num_hidden_layers or own_layers
    positions = shape.layer_positions or tuple(range(own_layers))
    assert len(positions) == own_layers
    partitions = pp_partition(hidden, pp, request.pp_layer_partition)
    if any(p < 0 for p in partitions):
        raise UnsupportedModel(
            f"pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) {list(partitions)} has a "
            "negative entry"
        )
    bounds = []
    start = 0
    for count in partitions:
        bounds.append((start, start + count))
        start += count
    stage_of: list[int] = []
    stage = 0
    for position in positions:  # cache layers come in decoder-layer order
        while position >= bounds[stage][1]:
            stage += 1
        stage_of.append(stage)
    stage_of += [pp - 1] * (len(shape.layers) - own_layers)  # the drafter: last stage
    members: list[list[int]] = [[] for _ in range(pp)]
    for index, s in enumerate(stage_of):
        members[s].append(index)
    empty = [s for s in range(pp) if not members[s]]
    if empty:
        what = (
            f"pipeline_parallel_size {pp} exceeds the model's {hidden} decoder layers"
            if pp > hidden and request.pp_layer_partition is None
            else f"the split {list(partitions)} of the model's {hidden} decoder layers"
        )
        raise UnsupportedModel(
            f"{what}: stage(s) {empty} would hold no KV-cache layer, and vLLM's KV "
            "planning fails for a worker without one (its block is 0 bytes)"
        )
    if shape.compressed_sparse_mla:
        kinds = set(shape.layers[:own_layers])
        for s in range(pp):
            if {shape.layers[i] for i in members[s] if i < own_layers} != kinds:
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds only some of {shape.architecture}'s kinds of cache (compress "
                    "ratios): its worker picks its block from its own layers' backends (vLLM "
                    "fails on some such splits), so only splits where every stage holds "
                    "every kind are modelled; give pipeline_layer_partition "
                    "(VLLM_PP_LAYER_PARTITION) such a split"
                )
    if shape.mamba is not None:
        for s in range(pp):
            if all(shape.layers[i].kind == "mamba" for i in members[s]):
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds only {shape.mamba.family} state layers: its worker sets its block "
                    "size without an attention layer (vLLM's update_block_size_for_backend "
                    "finds no attention backend and skips the hybrid alignment), so its "
                    "states do not match the other stages' blocks; give "
                    "pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) a split that puts "
                    "an attention layer on every stage"
                )
            gdn_grid = gdn_checkpoint_alignment(layout.gdn_prefill_kernel)
            if (
                shape.gdn
                and gdn_grid
                and layout.mamba_cache_mode == "align"
                and not any(shape.layers[i].kind == "mamba" for i in members[s])
            ):
                raise UnsupportedModel(
                    f"pipeline stage {s} (decoder layers {bounds[s][0]}-{bounds[s][1] - 1}) "
                    f"holds no {shape.mamba.family} layer: its worker aligns its block "
                    f"without the GDN kernel's {gdn_grid}-token checkpoint grid (vLLM reads it "
                    "from the stage's own layers), so its blocks do not match the other "
                    "stages'; give pipeline_layer_partition (VLLM_PP_LAYER_PARTITION) a "
                    "split that puts a GDN layer on every stage"
                )
    stages = []
    for s in range(pp):
        mine = set(members[s])
        groups = tuple(_project(g, mine) for g in layout.groups)
        widest = max(g.bytes_per_block for g in groups)
        if layout.block_outer:
            stride = math.lcm(*(specs[i].stride_alignment for i in members[s]))
            widest = round_up(widest, stride)
        stage_layout = replace(
            layout,
            groups=groups,
            worker_bytes_per_block=widest,
            draft_layers=sum(1 for i in members[s] if i >= own_layers),
            notes=(),
        )
        stages.append(
            Stage(
                index=s,
                first_layer=bounds[s][0],
                end_layer=bounds[s][1],
                cache_layers=tuple(members[s]),
                draft_layers=stage_layout.draft_layers,
                layout=stage_layout,
            )
        )
    notes = list(layout.notes)
    if request.pp_layer_partition is None and hidden % pp:
        notes.append(
            f"{hidden} decoder layers split unevenly over {pp} stages: {list(partitions)} "
            "(vLLM's get_pp_indices; VLLM_PP_LAYER_PARTITION overrides it)"
        )
    sizes = {st.layout.worker_bytes_per_block for st in stages}
    if len(sizes) > 1:
        notes.append(
            f"the stages' workers hold {sorted(sizes)} bytes per block: vLLM's scheduler "
            "and its CPU offloader's manager take stage 0's KV-cache config, each stage's "
            "workers their own"
        )
    return replace(layout, stages=tuple(stages), notes=tuple(notes))


def _project(group: KVGroup, mine: set[int]) -> KVGroup:
    """``_project_kv_cache_groups_to_worker``: the group with only this worker's layers;
    a group of mixed pages (``UniformTypeKVCacheSpecs``) keeps those layers' pages (all
    of them, as vLLM keeps the spec, when the worker holds none)."""
    kept = tuple(i for i in group.layer_indices if i in mine)
    if len(kept) == group.num_layers:
        return group
    if not group.layer_page_bytes:
        return replace(group, layer_indices=kept, padded_layers=0)
    if not kept:
        return replace(
            group, layer_indices=(), padded_layers=0, layer_page_bytes=(), layer_true_page_bytes=()
        )
    where = [k for k, i in enumerate(group.layer_indices) if i in mine]
    pages = tuple(group.layer_page_bytes[k] for k in where)
    true_pages = (
        tuple(group.layer_true_page_bytes[k] for k in where) if group.layer_true_page_bytes else ()
    )
    return replace(
        group,
        layer_indices=kept,
        page_bytes=sum(pages),
        layer_page_bytes=pages,
        layer_true_page_bytes=true_pages,
        padded_layers=0,
    )
