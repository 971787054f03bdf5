"""KV-cache layout: the KV-cache groups vLLM 0.33.0 builds for a model. THE one place.

From a model's shape (``planner/shape.py``, made from its config.json by the rule
of its family in ``planner/families/``) and the deployment (parallelism, dtypes, GPU,
prefix caching) :func:`compute_layout` computes what vLLM's engine core computes at
start-up with the OffloadingConnector on (layer-outer ``LBHNC`` layout, hybrid KV cache
manager on), in steps, each in its own module:

0. the KV dtype and the attention backend vLLM picks (``attention_backend.py``);
1. per-layer cache specs on one rank (``Attention``/``MLAAttention``/``MambaBase``
   ``get_kv_cache_spec``), with KV heads split over TP and replicated when TP exceeds
   them (``ModelConfig.get_num_kv_heads``: ``max(1, kv_heads // tp)``)
   (``layer_specs.py``; a drafter's layers appended by ``drafter.py``);
2. the block size (``Platform.update_block_size_for_backend``): the kernels' preferred
   size, then for attention+Mamba hybrids ``_align_hybrid_block_size`` (block raised
   until an attention page holds a Mamba state, Mamba page padded to match)
   (``block_size.py``);
3. the groups (``kv_cache_planning.get_kv_cache_groups``): one group when every layer
   has the same spec, else page unification and buckets cut into ``group_size`` layers
   assigned ``layers[i::n]`` (``kv_groups.py``);
4. the backing allocation's bytes per block per rank (the largest group) and
   ``tokens_per_hash`` (``resolve_kv_cache_block_sizes``) (``kv_groups.py``);
5. under pipeline parallelism, each stage's share (``pipeline_stages.py``).

The records it returns are in ``layout_types.py``; this module re-exports them and the
pipeline helpers, so callers import from here. It never imports vLLM;
``tests/contract`` checks it against vLLM's own code. Unsupported architectures raise
:class:`UnsupportedModel` naming what is missing.
"""

from __future__ import annotations

import math
from dataclasses import replace

from spillway_engine.planner.attention_backend import (
    check_kv_dtype,
    choose_backend,
    resolve_kv_dtype,
)
from spillway_engine.planner.block_size import hybrid_block, kernel_block_size
from spillway_engine.planner.drafter import SPECULATIVE_METHODS, check_drafter, with_drafter
from spillway_engine.planner.gpus import GdnKernel, Gpu
from spillway_engine.planner.kv_groups import group_layers, packed_groups, tokens_per_hash
from spillway_engine.planner.layer_specs import (
    compressed_page_bytes,
    layer_specs,
    state_spec,
    token_bytes,
)
from spillway_engine.planner.layout_types import (
    CacheSpec,
    KVGroup,
    KVLayout,
    LayoutRequest,
    Stage,
)
from spillway_engine.planner.pipeline_stages import (
    parse_pp_layer_partition,
    pp_indices,
    pp_partition,
    with_stages,
)
from spillway_engine.planner.shape import DTYPE_BYTES, ModelShape, UnsupportedModel
from spillway_engine.planner.sparse_mla import (
    INDEXER_PAGE_TOKENS,
    choose_sparse,
    hooked_kv_dtype,
)
from spillway_engine.planner.sparse_mla import (
    block_alignment as sparse_block_alignment,
)

__all__ = [
    "SPECULATIVE_METHODS",
    "KVGroup",
    "KVLayout",
    "LayoutRequest",
    "Stage",
    "compressed_page_bytes",
    "compute_layout",
    "parse_pp_layer_partition",
    "pp_indices",
    "pp_partition",
]


def compute_layout(shape: ModelShape, gpu: Gpu, request: LayoutRequest) -> KVLayout:
    """The KV-cache groups, hash unit and bytes per block vLLM 0.33.0 builds."""
    shape = _checked(shape, request)
    tp = request.tensor_parallel_size
    sparse = None
    if shape.sparse_dims is None:
        kv_dtype, kv_bytes = resolve_kv_dtype(shape, request.kv_cache_dtype, gpu)
    else:
        # the architecture's config hook rewrites the cache dtype before anything reads
        # it; vLLM's config checks, then the sparse backend, which decides the format
        hooked = hooked_kv_dtype(shape, gpu, request.kv_cache_dtype)
        request = replace(request, kv_cache_dtype=hooked)
        shape = replace(shape, block_alignment=sparse_block_alignment(shape, gpu))
        check_kv_dtype(shape, gpu, hooked)
        sparse = choose_sparse(shape, gpu, hooked, request.block_size, tp)
        kv_dtype = shape.dtype if sparse.kv_cache_dtype == "auto" else sparse.kv_cache_dtype
        kv_bytes = DTYPE_BYTES[kv_dtype]
    notes = list(shape.notes)
    if shape.compressed_sparse_mla:
        return _packed_layout(shape, gpu, request, notes)
    # The target's layers pick the backend and block size (update_block_size_for_backend
    # reads the model config); a drafter selects its own backend for its layers.
    backend = (sparse.backend if sparse else
               choose_backend(shape, gpu, request.kv_cache_dtype, request.block_size, tp))
    own_layers = len(shape.layers)
    check_drafter(shape, request)
    shape, num_spec = with_drafter(shape, request, notes)
    tokens = token_bytes(shape, tp, kv_dtype, kv_bytes, backend, notes, sparse)
    block = kernel_block_size(request, backend, gpu)
    if sparse is not None:
        block = _with_indexer_pages(block, request)
    gdn_kernel: GdnKernel | None = (
        gpu.gdn_prefill_kernel(shape.gdn_head_k_dim, request.cuda_major) if shape.gdn else None
    )
    hybrid = hybrid_block(
        shape, gpu, request, backend, block, tokens.aligned_per_token, gdn_kernel, num_spec,
        notes,
    )
    specs = layer_specs(
        shape, hybrid.block, hybrid.mamba_block, hybrid.mamba_page, hybrid.mamba_padded,
        tokens, num_spec,
    )
    groups, block_outer, worker_bytes = group_layers(specs, notes)
    # MLA latents are identical on every TP rank (max_tp_shards = 1); Mamba states are
    # split over TP, so a hybrid's ranks do not hold identical caches (the gcd is 1).
    tp_replicas = tp if shape.mla_latent and shape.mamba is None else 1
    layout = KVLayout(
        shape=shape,
        gpu=gpu,
        attention_backend=backend.name if backend else None,
        kv_cache_dtype=kv_dtype,
        kv_dtype_bytes=kv_bytes,
        block_size=hybrid.block,
        mamba_cache_mode=hybrid.mamba_mode,
        mamba_page_bytes=hybrid.mamba_page,
        mamba_page_padded_bytes=hybrid.mamba_padded,
        groups=groups,
        tokens_per_hash=tokens_per_hash(groups, hybrid.mamba_mode),
        worker_bytes_per_block=worker_bytes,
        kv_heads_per_rank=tokens.kv_heads,
        tp_replicas=tp_replicas,
        notes=tuple(notes),
        draft_layers=len(shape.layers) - own_layers,
        block_outer=block_outer,
        gdn_prefill_kernel=gdn_kernel,
    )
    return with_stages(layout, own_layers, specs, request)


def _with_indexer_pages(block: int, request: LayoutRequest) -> int:
    """The sparse indexer's backend beside the latents' runs exactly 64-token DeepGEMM
    pages (``DeepseekV32IndexerBackend``): vLLM's block is the smallest size both backends
    take (``_preferred_block_size_for_backends``); a forced one must be a multiple."""
    if request.block_size is None:
        return math.lcm(block, INDEXER_PAGE_TOKENS)
    if block % INDEXER_PAGE_TOKENS:
        raise UnsupportedModel(
            f"--block-size {block} with sparse MLA: the indexer's kernels run "
            f"{INDEXER_PAGE_TOKENS}-token pages, so vLLM's worker cannot split the blocks; "
            f"use a multiple of {INDEXER_PAGE_TOKENS}"
        )
    return block


def _checked(shape: ModelShape, request: LayoutRequest) -> ModelShape:
    """Refuses the parallelism and dtypes vLLM refuses or the planner does not model;
    the shape in the requested dtype."""
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
    return shape


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
    shape, _ = with_drafter(shape, request, notes)
    block = backend.blocks.preferred()
    if request.block_size is not None and request.block_size != block:
        raise UnsupportedModel(
            f"--block-size {request.block_size} with {shape.architecture}: only "
            f"{backend.name}'s own {block}-token pages are modelled (other multiples change "
            "the compressed pages' block-stride alignment)"
        )
    made: dict[int, CacheSpec] = {}
    specs = []
    for layer in shape.layers:
        spec = made.get(id(layer))
        if spec is None:
            spec = made[id(layer)] = state_spec(layer, block)
        specs.append(spec)
    groups = packed_groups(specs)
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
        tokens_per_hash=tokens_per_hash(groups, None),
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
    return with_stages(layout, own_layers, specs, request)
