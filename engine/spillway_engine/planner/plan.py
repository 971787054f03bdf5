"""The plan: KV groups, chunk geometry, host pool and pod memory for one deployment.

``make_plan(config, request)`` is the one entry point the CLI, the operator and the
engine use. It is pure (no I/O, no vLLM import) and raises :class:`PlanRefused` with
the reason vLLM would give, or the piece Spillway does not model.

Assumptions (vLLM 0.33.0 defaults): OffloadingConnector on (layout LBHNC), hybrid KV
cache manager on, speculative decoding only as asked (``speculative_method``; a
separate drafter's config.json is ``make_plan``'s ``draft_config``), no decode/prefill
context parallelism,
``mp`` executor on one node, ``--prefix-cache-retention-interval`` at its default.

Pipeline parallelism (``pipeline_parallel_size`` > 1): vLLM groups the whole model's
layers once, and every stage's workers hold those groups with only the stage's layers.
The plan's top-level figures (``worker_bytes_per_block``, rows, chunks, capacity) are
then stage 0's, the KV-cache config vLLM's scheduler and its offloader's manager take;
``stages`` gives each stage's layers, groups and host pool as its workers compute them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spillway_engine import __version__
from spillway_engine.planner.families import model_shape
from spillway_engine.planner.families.dense import ARCHITECTURES as DENSE_ARCHITECTURES
from spillway_engine.planner.families.eagle3 import LLAMA_EAGLE3, eagle3_shape
from spillway_engine.planner.gpus import DEFAULT_CUDA_MAJOR, DEFAULT_GPU, UnknownGpu, get_gpu
from spillway_engine.planner.kv_layout import KVLayout, LayoutRequest, compute_layout
from spillway_engine.planner.offload_geometry import (
    OffloadRefused,
    OffloadRequest,
    SpillwayGeometry,
    UpstreamGeometry,
    disk_geometry,
    spillway_connector_refusal,
    spillway_geometry,
    upstream_geometry,
)
from spillway_engine.planner.pod_sizing import (
    PodMemory,
    PodSizingError,
    max_pool_bytes,
    size_pod,
)
from spillway_engine.planner.shape import ModelConfigError, ModelShape, UnsupportedModel
from spillway_engine.vllm_pins import (
    SPILLWAY_CONNECTOR,
    SPILLWAY_CONNECTOR_MODULE,
    UPSTREAM_CONNECTOR,
    VLLM_VERSION,
)


class PlanRefused(Exception):
    """The deployment cannot run as asked; ``reason`` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanRequest(_Model):
    """Deployment inputs. Sizes are bytes; every count must be positive."""

    model_name: str | None = Field(None, description="Model id or path, for the record.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine sharing heads.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages.")
    pipeline_layer_partition: list[int] | None = Field(
        None,
        description="VLLM_PP_LAYER_PARTITION: decoder layers per pipeline stage; null: "
        "vLLM's own split.",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Data-parallel engines of a replica, each with a pool: all in the pod on "
        "one node, data_parallel_size / nodes a pod across nodes.",
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Nodes (pods) one replica spans: vLLM's --nnodes. Data-parallel size "
        "1: the engine's tensor and pipeline ranks split evenly, each node maps the whole "
        "host pool region. Above 1: each node holds data_parallel_size / nodes whole "
        "engines (vLLM's --data-parallel-size-local), each with its own pool.",
    )
    dtype: Literal["auto", "bfloat16", "float16"] = Field("auto", description="vLLM --dtype.")
    kv_cache_dtype: str = Field("auto", description="vLLM --kv-cache-dtype.")
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM --max-model-len; default: the config's context length."
    )
    block_size: int | None = Field(None, ge=1, description="vLLM --block-size if forced.")
    enable_prefix_caching: bool = Field(True, description="vLLM --enable-prefix-caching.")
    blocks_per_chunk: int | None = Field(
        None, description="GPU blocks per offload chunk; default: a size vLLM accepts."
    )
    chunk_block_size_tokens: int | None = Field(
        None,
        description="The legacy token-based 'block_size' offload key (validation only).",
    )
    cpu_memory_bytes: int | None = Field(
        None, description="Host pool per engine; default: the largest that fits the limit."
    )
    host_memory_scope: Literal["engine", "pod"] = Field(
        "engine",
        description="Whose budget cpu_memory_bytes is: each data-parallel engine's, or the "
        "pod's, split evenly across its engines.",
    )
    memory_limit_bytes: int | None = Field(
        None, ge=1, description="Container memory limit to fit (optional)."
    )
    offloader: Literal["upstream", "spillway"] = Field(
        "spillway", description="Which offloader's geometry sizes the pool."
    )
    disk_bytes: int | None = Field(
        None,
        ge=1,
        description="Disk tier under the host pool: the pod's volume (a shared volume's "
        "whole size), split across its engines and disk_writers; null: no disk tier.",
    )
    disk_writers: int = Field(
        1,
        ge=1,
        description="Pods writing one shared disk volume (at most): each keeps its share.",
    )
    gpu: str = Field(DEFAULT_GPU, description="GPU model (see spillway_engine.planner.gpus).")
    cuda_major: int = Field(
        DEFAULT_CUDA_MAJOR,
        ge=12,
        le=13,
        description="CUDA runtime major of the engine image (vLLM 0.33.0's is 13); on "
        "Blackwell a CUDA 12 build runs Triton's GDN prefill kernel, not FlashInfer's.",
    )
    speculative_method: Literal["mtp", "draft_model", "eagle3"] | None = Field(
        None,
        description="vLLM --speculative-config method: mtp (the model's MTP heads), "
        "draft_model or eagle3 (a separate drafter: make_plan's draft_config).",
    )
    num_speculative_tokens: int = Field(
        0, ge=0, description="--speculative-config num_speculative_tokens (with a method)."
    )
    speculative_model: str | None = Field(
        None,
        description="--speculative-config model: the drafter's id or path (draft_model, "
        "eagle3), for the record and the engine's flag.",
    )


class GpuInfo(_Model):
    name: str = Field(description="Catalogue name, e.g. h100.")
    product: str = Field(description="Marketing name.")
    generation: str = Field(description="ampere, ada or hopper.")
    compute_capability: str = Field(description="SM version, e.g. 9.0.")
    attention_backend: str | None = Field(description="vLLM attention backend picked.")
    gdn_prefill_kernel: str = Field(description="GDN prefill kernel (hybrid GDN models).")


class ModelInfo(_Model):
    name: str | None = Field(description="Model id or path given.")
    architecture: str = Field(description="config.json architectures[0].")
    model_type: str = Field(description="config.json model_type.")
    dtype: str = Field(
        description="Activation dtype (--dtype; auto: the checkpoint's, fp32->bf16)."
    )
    num_cache_layers: int = Field(description="Layers holding KV cache or Mamba state.")


class Parallelism(_Model):
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    world_size: int = Field(description="GPU workers per engine (TP x PP).")
    pipeline_layer_partition: list[int] | None = Field(
        None, description="VLLM_PP_LAYER_PARTITION the engine sets, or null (vLLM's split)."
    )
    nodes: int = Field(
        1,
        description="Nodes (pods) the replica spans: one engine's ranks (vLLM --nnodes), or "
        "data_parallel_size / nodes whole engines a node; pod figures are per node.",
    )


class KVGroupInfo(_Model):
    kind: Literal[
        "full_attention", "sliding_window", "chunked_local", "mla", "mamba", "circular_buffer"
    ] = Field(description="Cache type of the group's layers.")
    num_layers: int = Field(description="Real layers in the group (padding excluded).")
    layer_indices: list[int] = Field(description="Indices among the cache-holding layers.")
    tokens_per_block: int = Field(description="Tokens per GPU block of this group.")
    page_bytes: int = Field(description="Bytes of one layer's block on one rank, unified.")
    bytes_per_block: int = Field(description="page_bytes x num_layers.")
    sliding_window: int | None = Field(description="Window in tokens, or null.")
    attention_chunk_size: int | None = Field(None, description="Chunked-local span, or null.")
    padded_layers: int = Field(0, description="Padding layers vLLM adds to this group.")
    layer_page_bytes: list[int] = Field(
        default_factory=list,
        description="Each layer's page when they differ (one attention type, other heads: "
        "a draft model's layers); page_bytes and bytes_per_block are then their sum.",
    )
    prefix_cacheable: bool = Field(
        True, description="False for a per-request ring (circular buffer): never offloaded."
    )
    backend: str | None = Field(
        None,
        description="The kernels vLLM runs this group's layers on: the attention backend, "
        "or for state layers their family's kernels (GDN's prefill kernel named).",
    )


class GroupChunkInfo(_Model):
    group_index: int
    tokens_per_block: int
    blocks_per_chunk: int = Field(description="GPU blocks of this group per chunk.")
    tokens_per_chunk: int
    chunk_bytes: int = Field(description="True KV bytes of one chunk of this group, all ranks.")
    row_bytes: int = Field(description="Host bytes one chunk of this group occupies.")
    window_chunks: int | None = Field(description="Chunks a lookup needs (SWA/Mamba), or null.")
    units: int = Field(1, description="Host pool units one chunk takes (Spillway).")


class UpstreamInfo(_Model):
    """vLLM 0.33.0's own CPUOffloadingSpec figures (every group key takes one row)."""

    blocks_per_chunk: int
    copies: int = Field(description="Copies per row: workers, or 1 for replicated MLA.")
    replicated_layout: bool
    row_bytes: int = Field(description="round_up(worker_bytes_per_block x copies x bpc, 4096).")
    num_chunks: int = Field(description="cpu_bytes // row_bytes.")
    region_bytes: int = Field(description="num_chunks x row_bytes (the /dev/shm file).")
    capacity_tokens: int = Field(description="Prefix tokens held if every group keeps all.")
    gauge_tokens: int = Field(description="vLLM's cpu_kv_cache_size_tokens at max_model_len.")
    groups: list[GroupChunkInfo]
    kv_connector_extra_config: dict[str, Any]


class SpillwayInfo(_Model):
    """Spillway's per-group chunking: one token span, byte-exact slots per group."""

    chunk_tokens: int = Field(description="Common chunk span T for every group.")
    copies: int
    unit_bytes: int = Field(description="Bytes of one host pool unit on one worker.")
    num_units: int = Field(description="cpu_bytes // (unit_bytes x copies).")
    groups: list[GroupChunkInfo]
    row_layout: str = Field(description="How rows are laid out in the region.")
    chunk_set_bytes: int = Field(description="Sum of the groups' slots: one span, all groups.")
    num_chunks: int = Field(description="num_units // units of one chunk of every group.")
    region_bytes: int
    capacity_tokens: int = Field(description="num_chunks x chunk_tokens.")
    gauge_tokens: int = Field(description="Tokens at max_model_len, windows counted.")
    kv_connector_extra_config: dict[str, Any]


class PodInfo(_Model):
    shm_bytes: int = Field(description="/dev/shm (emptyDir medium Memory) size limit.")
    memory_request_bytes: int = Field(description="Container memory request.")
    memory_limit_bytes: int = Field(description="Container memory limit (pool counted).")
    pool_bytes_per_engine: int = Field(description="Offload region per engine.")
    engines: int = Field(1, description="Data-parallel engines in the pod, each with a region.")
    pool_bytes_per_pod: int | None = Field(
        None, description="engines x pool_bytes_per_engine: all regions of the pod."
    )
    host_memory_scope: Literal["engine", "pod"] = Field(
        "engine", description="How the requested host budget was read: per engine or per pod."
    )
    process_overhead_bytes: int = Field(description="Engine + worker process memory.")
    headroom_bytes: int = Field(description="Limit minus request.")


class DiskTierInfo(_Model):
    """The second tier: chunk files on a volume, evicted LRU within a byte budget."""

    volume_bytes: int = Field(description="The volume's size (a shared volume's whole).")
    writers: int = Field(description="Pods sharing the volume, each keeping its share.")
    volume_bytes_per_engine: int = Field(description="volume_bytes // (engines x writers).")
    budget_bytes_per_engine: int = Field(
        description="Complete chunk files an engine keeps at most (the rest stays free "
        "for writes in flight)."
    )
    file_bytes: list[int] = Field(
        description="On disk, one chunk of each offloaded group: its host rows."
    )
    chunk_set_bytes: int = Field(description="Sum of file_bytes: one span, all groups.")
    num_chunks: int = Field(description="budget_bytes_per_engine // chunk_set_bytes.")
    capacity_tokens: int = Field(description="num_chunks x chunk_tokens, per engine.")
    cache_key: str = Field(
        description="Digest of what a chunk file's bytes depend on: files are kept under "
        "it, so a plan with another key never reads them."
    )
    hash_algo: str = Field(
        description="--prefix-caching-hash-algo: a fixed-seed hash, so every writer of "
        "a shared volume names the same prefix alike."
    )


class StageInfo(_Model):
    """One pipeline stage: its layers and what each of its TP workers holds and offloads."""

    stage: int = Field(description="Pipeline rank.")
    first_layer: int = Field(description="First decoder layer of the stage.")
    end_layer: int = Field(description="One past its last decoder layer.")
    num_cache_layers: int = Field(description="Cache layers on the stage (drafter's included).")
    cache_layer_indices: list[int] = Field(
        description="The stage's cache layers, as indices among the whole model's."
    )
    draft_layer_indices: list[int] = Field(
        default_factory=list, description="The drafter's cache layers (on the last stage)."
    )
    workers: int = Field(description="Workers of the stage (its TP ranks).")
    kv_groups: list[KVGroupInfo] = Field(
        description="Every KV-cache group of the model with only this stage's layers (a "
        "group may hold none here): the stage's workers' KV-cache config."
    )
    worker_bytes_per_block: int = Field(description="One block of a stage worker's allocation.")
    upstream: UpstreamInfo | None = Field(
        description="vLLM's offloader as this stage's workers size it, or null if refused."
    )
    upstream_refusal: str | None = Field(None, description="Why vLLM's offloader refuses.")
    spillway: SpillwayInfo | None = Field(
        description="Spillway's geometry for this stage's groups, or null if refused."
    )
    spillway_refusal: str | None = Field(None, description="Why Spillway's refuses it.")
    region_bytes: int = Field(description="The chosen offloader's host region for the stage.")


class Plan(_Model):
    """Everything the operator and the engine need to agree on. Stable JSON."""

    vllm_version: str = Field(description="vLLM release the geometry mirrors.")
    spillway_version: str = Field(description="Spillway release that made the plan.")
    gpu: GpuInfo
    model: ModelInfo
    parallelism: Parallelism
    kv_cache_dtype: str = Field(description="Resolved KV dtype (bfloat16, float16, fp8...).")
    max_model_len: int
    block_size: int = Field(description="cache_config.block_size after alignment.")
    enable_prefix_caching: bool
    mamba_cache_mode: str | None = Field(description="align / none for Mamba hybrids.")
    kv_groups: list[KVGroupInfo]
    tokens_per_hash: int = Field(description="Hash unit (Request.block_hashes granularity).")
    worker_bytes_per_block: int = Field(description="One block of the backing allocation.")
    offloader: Literal["upstream", "spillway"]
    blocks_per_chunk: int = Field(
        description="Upstream: the global bpc. Spillway: the finest group's bpc."
    )
    cpu_memory_bytes: int = Field(
        description="Host pool budget per engine (a per-pod budget already split)."
    )
    row_bytes: int = Field(description="Upstream: one row. Spillway: one chunk set.")
    num_chunks: int
    capacity_tokens: int
    upstream: UpstreamInfo | None = Field(description="vLLM's figures, null if refused.")
    upstream_refusal: str | None = Field(None, description="Why vLLM's offloader refuses.")
    spillway: SpillwayInfo
    kv_connector_extra_config: dict[str, Any] = Field(
        description="Exactly the kv_connector_extra_config the engine passes."
    )
    kv_transfer_config: dict[str, Any] = Field(description="The whole --kv-transfer-config.")
    pod: PodInfo
    disk: DiskTierInfo | None = Field(None, description="The disk tier, or null.")
    notes: list[str]
    speculative_method: str | None = Field(
        None, description="--speculative-config method the groups include a drafter for."
    )
    num_speculative_tokens: int = Field(
        0, description="--speculative-config num_speculative_tokens (0 without a drafter)."
    )
    speculative_model: str | None = Field(
        None, description="--speculative-config model (a separate drafter), or null."
    )
    draft_layer_indices: list[int] = Field(
        default_factory=list, description="Cache layers the drafter adds (last in order)."
    )
    stages: list[StageInfo] = Field(
        default_factory=list,
        description="Pipeline stages, each with its layers, KV groups and host pool; empty "
        "without pipeline parallelism.",
    )

    def speculative_config(self) -> dict[str, Any] | None:
        """The --speculative-config the engine passes, or None without a drafter."""
        if self.speculative_method is None:
            return None
        out: dict[str, Any] = {
            "method": self.speculative_method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.speculative_model is not None:
            out["model"] = self.speculative_model
        return out


class PlanReadError(ValueError):
    """A plan this engine cannot use; the message is one line naming the problem."""


class _Stamp(BaseModel):
    """Only the two versions, read before the whole plan so that a plan of another
    release is named as such rather than by the first field it spells differently."""

    model_config = ConfigDict(extra="ignore")

    vllm_version: str | None = None
    spillway_version: str | None = None


def read_plan(text: str | bytes, source: str) -> Plan:
    """The plan in ``text`` (JSON, as ``spillway plan --format json`` writes it).

    Every reader of a plan goes through here. Raises :class:`PlanReadError`, one line
    naming ``source``: a plan made by another Spillway or for another vLLM names both
    releases; malformed JSON or a plan that does not fit :class:`Plan` names the field.
    """
    try:
        plan = Plan.model_validate_json(text)
    except ValidationError as e:
        stamp = _stamp(text)
        if stamp is not None and _other_release(stamp):
            raise PlanReadError(_release_message(stamp, source)) from None
        raise PlanReadError(_validation_message(e, source)) from None
    if _other_release(plan):
        raise PlanReadError(_release_message(plan, source))
    return plan


def _stamp(text: str | bytes) -> _Stamp | None:
    try:
        return _Stamp.model_validate_json(text)
    except ValidationError:
        return None


def _other_release(stamp: _Stamp | Plan) -> bool:
    """Both versions must be this install's; a missing one is left to validation."""
    return any(
        found is not None and found != ours
        for found, ours in (
            (stamp.vllm_version, VLLM_VERSION),
            (stamp.spillway_version, __version__),
        )
    )


def _release_message(stamp: _Stamp | Plan, source: str) -> str:
    return (
        f"plan {source} was made by Spillway {stamp.spillway_version or '(unknown)'} for "
        f"vLLM {stamp.vllm_version or '(unknown)'}; this engine is Spillway {__version__} "
        f"with vLLM {VLLM_VERSION} (re-plan with this release)"
    )


def _field_name(loc: tuple[int | str, ...]) -> str:
    """``('kv_groups', 0, 'kind')`` -> ``kv_groups[0].kind``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _validation_message(error: ValidationError, source: str) -> str:
    errors = error.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"plan {source} is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}"
    if not first["loc"]:
        return f"plan {source} is not a JSON object"
    if all(e["type"] == "missing" for e in errors):
        missing = ", ".join(_field_name(e["loc"]) for e in errors)
        return f"plan {source} is missing {missing} (make it with `spillway plan --format json`)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = " ".join(str(first["msg"]).split())  # one line whatever pydantic says
    return f"plan {source}: {_field_name(first['loc'])}: {message}{more}"


def _chunks(geometry: UpstreamGeometry | SpillwayGeometry) -> list[dict[str, Any]]:
    return [
        dict(
            group_index=g.group_index,
            tokens_per_block=g.tokens_per_block,
            blocks_per_chunk=g.blocks_per_chunk,
            tokens_per_chunk=g.tokens_per_chunk,
            chunk_bytes=g.chunk_bytes,
            row_bytes=g.row_bytes,
            window_chunks=g.window_chunks,
            units=g.units,
        )
        for g in geometry.groups
    ]


def _draft_layers(layout: KVLayout) -> list[int]:
    """Indices of the drafter's cache layers: appended after the model's own."""
    total = len(layout.shape.layers)
    return list(range(total - layout.draft_layers, total))


def _vocab_size(config: dict[str, Any]) -> Any:
    text = config.get("text_config")
    return (text if isinstance(text, dict) else config).get("vocab_size")


def _drafter(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None
) -> ModelShape | None:
    """The separate drafter's shape (draft model or EAGLE-3 head), or None."""
    method = request.speculative_method
    if method not in ("draft_model", "eagle3"):
        if draft_config is not None:
            raise PlanRefused(
                f"a drafter config.json is only read for draft_model or eagle3, not {method!r}"
            )
        return None
    if draft_config is None:
        return None  # compute_layout refuses with the reason
    if method == "draft_model":
        target, draft = _vocab_size(config), _vocab_size(draft_config)
        if target != draft:  # SpeculativeConfig.verify_equal_vocab_size_if_draft_model
            raise PlanRefused(
                "Target and draft model should have the same vocabulary size. "
                f"Target model vocab_size={target}. Draft model vocab_size={draft}."
            )
        return _own_windows(model_shape(draft_config), draft_config)
    return _own_windows(eagle3_shape(draft_config), draft_config)


def _own_windows(drafter: ModelShape, draft_config: dict[str, Any]) -> ModelShape:
    """A drafter's sliding layers must say so per layer (layer_types): a Llama-style
    layer without one takes the target's cache window in vLLM, not its config's."""
    text = draft_config.get("text_config")
    declared = (text if isinstance(text, dict) else draft_config).get("layer_types")
    sliding = any(layer.kind == "sliding_window" for layer in drafter.layers)
    llama_style = drafter.architecture in {*DENSE_ARCHITECTURES, *LLAMA_EAGLE3}
    if sliding and declared is None and llama_style:
        raise UnsupportedModel(
            f"a {drafter.architecture} drafter whose sliding_window applies to every layer "
            "without layer_types is not modelled (vLLM gives its layers the target's window)"
        )
    return drafter


def _layout(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None = None
) -> tuple[KVLayout, int]:
    shape = model_shape(config)
    drafter = _drafter(config, request, draft_config)
    max_len = request.max_model_len or shape.derived_max_model_len
    if max_len > shape.derived_max_model_len:
        raise PlanRefused(
            f"max_model_len {max_len} exceeds the model's context length "
            f"{shape.derived_max_model_len} (vLLM refuses it unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
        )
    layout = compute_layout(
        shape,
        get_gpu(request.gpu),
        LayoutRequest(
            tensor_parallel_size=request.tensor_parallel_size,
            pipeline_parallel_size=request.pipeline_parallel_size,
            pp_layer_partition=(
                None
                if request.pipeline_layer_partition is None
                else tuple(request.pipeline_layer_partition)
            ),
            kv_cache_dtype=request.kv_cache_dtype,
            dtype=request.dtype,
            max_model_len=max_len,
            block_size=request.block_size,
            enable_prefix_caching=request.enable_prefix_caching,
            speculative_method=request.speculative_method,
            num_speculative_tokens=request.num_speculative_tokens,
            drafter=drafter,
            cuda_major=request.cuda_major,
        ),
    )
    return layout, max_len


def make_plan(
    config: dict[str, Any],
    request: PlanRequest,
    draft_config: dict[str, Any] | None = None,
) -> Plan:
    """The plan for ``config`` (a parsed config.json) and ``request``, or PlanRefused.

    ``draft_config``: the separate drafter's config.json for ``speculative_method``
    draft_model or eagle3 (the ``model`` of vLLM's --speculative-config)."""
    try:
        return _make_plan(config, request, draft_config)
    except (ModelConfigError, UnsupportedModel, UnknownGpu, OffloadRefused, PodSizingError) as e:
        raise PlanRefused(str(e)) from e


def _make_plan(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None
) -> Plan:
    model_layout, max_len = _layout(config, request, draft_config)
    # the scheduler's view: stage 0's KV-cache config under pipeline parallelism
    layout = model_layout.stages[0].layout if model_layout.stages else model_layout
    workers = request.tensor_parallel_size * request.pipeline_parallel_size
    dp = request.data_parallel_size
    # The workers of each engine one pod holds and the engines it holds: pod memory and
    # the pool that fits it are per node.
    local, engines = _per_node(request, workers, dp)
    if model_layout.stages and request.disk_bytes is not None:
        raise PlanRefused(
            "offload.disk.size (--disk) with pipeline parallelism: the disk tier is not "
            "modelled for pipeline stages"
        )
    cpu_bytes = _pool_bytes(request, local, engines)
    upstream, upstream_refusal, spillway = _geometries(
        layout, request, cpu_bytes, workers, max_len
    )
    chosen = _chosen_offload(request.offloader, upstream, spillway)
    limit = request.memory_limit_bytes
    for _ in range(4 if request.cpu_memory_bytes is None else 0):
        # the pool filled the limit before its units (and the manager's bytes per
        # key) were known: give those bytes back from the pool (a row may round)
        needed = size_pod(chosen.region_bytes, local, engines, chosen.host_keys).memory_limit_bytes
        if limit is None or needed <= limit:
            break
        # from the region, not the budget: a budget short of a whole row above it
        # would give back bytes the region never held and change nothing
        cpu_bytes = min(cpu_bytes, chosen.region_bytes) - -(-(needed - limit) // engines)
        upstream, upstream_refusal, spillway = _geometries(
            layout, request, cpu_bytes, workers, max_len
        )
        chosen = _chosen_offload(request.offloader, upstream, spillway)
    stages, stage_notes = _stages(model_layout, request, cpu_bytes, workers, max_len)
    # Each stage's workers map their own region: a pod holds a stage's, the largest.
    region = max([chosen.region_bytes, *(s["region_bytes"] for s in stages)])
    pod = _sized_pod(region, local, engines, limit, chosen.host_keys)
    disk = _disk_tier(request, layout, spillway, workers, engines, max_len)
    # One validation of nested dicts (pydantic's core walks them) instead of a model
    # per group and chunk: a tenth of a millisecond on many-group models.
    return Plan.model_validate(dict(
        vllm_version=VLLM_VERSION,
        spillway_version=__version__,
        gpu=_gpu_info(layout),
        model=dict(
            name=request.model_name,
            architecture=layout.shape.architecture,
            model_type=layout.shape.model_type,
            dtype=layout.shape.dtype,
            num_cache_layers=len(layout.shape.layers),
        ),
        parallelism=dict(
            tensor_parallel_size=request.tensor_parallel_size,
            pipeline_parallel_size=request.pipeline_parallel_size,
            data_parallel_size=dp,
            world_size=workers,
            pipeline_layer_partition=request.pipeline_layer_partition,
            nodes=request.nodes,
        ),
        kv_cache_dtype=layout.kv_cache_dtype,
        max_model_len=max_len,
        block_size=layout.block_size,
        enable_prefix_caching=request.enable_prefix_caching,
        mamba_cache_mode=layout.mamba_cache_mode,
        kv_groups=_kv_groups(model_layout),
        tokens_per_hash=layout.tokens_per_hash,
        worker_bytes_per_block=layout.worker_bytes_per_block,
        offloader=request.offloader,
        blocks_per_chunk=chosen.blocks_per_chunk,
        cpu_memory_bytes=cpu_bytes,
        row_bytes=chosen.row_bytes,
        num_chunks=chosen.num_chunks,
        capacity_tokens=chosen.capacity_tokens,
        upstream=None if upstream is None else _upstream_info(upstream),
        upstream_refusal=upstream_refusal,
        spillway=_spillway_info(spillway),
        kv_connector_extra_config=chosen.extra_config,
        kv_transfer_config=chosen.transfer_config,
        pod=dict(
            shm_bytes=pod.shm_bytes,
            memory_request_bytes=pod.memory_request_bytes,
            memory_limit_bytes=pod.memory_limit_bytes,
            pool_bytes_per_engine=pod.pool_bytes_per_engine,
            engines=engines,
            pool_bytes_per_pod=engines * pod.pool_bytes_per_engine,
            host_memory_scope=request.host_memory_scope,
            process_overhead_bytes=pod.process_overhead_bytes,
            headroom_bytes=pod.headroom_bytes,
        ),
        disk=disk,
        notes=list(model_layout.notes) + stage_notes,
        speculative_method=request.speculative_method,
        num_speculative_tokens=request.num_speculative_tokens if request.speculative_method else 0,
        speculative_model=request.speculative_model if request.speculative_method else None,
        draft_layer_indices=_draft_layers(model_layout),
        stages=stages,
    ))


#: vLLM's default prefix hash: cryptographic, so its NONE_HASH seed is a fixed default
#: (kv_cache_utils.resolve_none_hash_seed) and every process hashes a prefix alike.
DISK_HASH_ALGO = "sha256"


def _disk_tier(
    request: PlanRequest,
    layout: KVLayout,
    spillway: SpillwayGeometry,
    workers: int,
    dp: int,
    max_len: int,
) -> dict[str, Any] | None:
    if request.disk_bytes is None:
        return None
    if request.offloader != "spillway":
        raise OffloadRefused("the disk tier runs under Spillway's offloader only")
    share = request.disk_bytes // (dp * request.disk_writers)
    try:
        disk = disk_geometry(spillway, share)
    except OffloadRefused as e:
        how = f" ({request.disk_bytes} bytes for {dp} engine(s) x {request.disk_writers} " \
            "writer(s))" if dp * request.disk_writers > 1 else ""
        raise OffloadRefused(f"offload.disk.size (--disk){how}: {e}") from None
    # Everything a chunk file's bytes depend on: another model, dtype, layout, chunk
    # span, rank count or vLLM release writes other bytes under the same prefix hash.
    key = json.dumps(dict(
        vllm=VLLM_VERSION,
        model=request.model_name,
        architecture=layout.shape.architecture,
        kv_cache_dtype=layout.kv_cache_dtype,
        max_model_len=max_len,
        block_size=layout.block_size,
        tokens_per_hash=layout.tokens_per_hash,
        groups=_kv_groups(layout),
        chunk_tokens=spillway.chunk_tokens,
        blocks_per_chunk=[g.blocks_per_chunk for g in spillway.groups],
        workers=workers,
        copies=spillway.copies,
        hash_algo=DISK_HASH_ALGO,
    ), sort_keys=True)
    return dict(
        volume_bytes=request.disk_bytes,
        writers=request.disk_writers,
        volume_bytes_per_engine=share,
        budget_bytes_per_engine=disk.budget_bytes,
        file_bytes=list(disk.file_bytes),
        chunk_set_bytes=disk.chunk_set_bytes,
        num_chunks=disk.num_chunks,
        capacity_tokens=disk.capacity_tokens,
        cache_key=hashlib.sha256(key.encode()).hexdigest()[:16],
        hash_algo=DISK_HASH_ALGO,
    )


def _stages(
    model_layout: KVLayout, request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each pipeline stage's layers, groups and both offloaders' host pools as the
    stage's workers size them (every worker builds its offloading spec from its own
    KV-cache config and the same cpu_bytes_to_use), and notes on how they differ."""
    out: list[dict[str, Any]] = []
    draft = set(_draft_layers(model_layout))
    for stage in model_layout.stages:
        layout = stage.layout
        upstream = spillway = None
        upstream_refusal = spillway_refusal = None
        offload = _offload_request(request, cpu_bytes, workers, max_len)
        try:
            upstream = upstream_geometry(layout, offload)
        except OffloadRefused as e:
            upstream_refusal = str(e)
        try:
            if request.offloader == "spillway" and (why := spillway_connector_refusal(layout)):
                raise OffloadRefused(why)
            spillway = spillway_geometry(layout, offload)
        except OffloadRefused as e:
            spillway_refusal = str(e)
        refusal = upstream_refusal if request.offloader == "upstream" else spillway_refusal
        if refusal is not None:
            raise OffloadRefused(f"pipeline stage {stage.index}: {refusal}")
        chosen = upstream if request.offloader == "upstream" else spillway
        assert chosen is not None
        out.append(dict(
            stage=stage.index,
            first_layer=stage.first_layer,
            end_layer=stage.end_layer,
            num_cache_layers=len(stage.cache_layers),
            cache_layer_indices=list(stage.cache_layers),
            draft_layer_indices=[i for i in stage.cache_layers if i in draft],
            workers=request.tensor_parallel_size,
            kv_groups=_kv_groups(layout),
            worker_bytes_per_block=layout.worker_bytes_per_block,
            upstream=None if upstream is None else _upstream_info(upstream),
            upstream_refusal=upstream_refusal,
            spillway=None if spillway is None else _spillway_info(spillway),
            spillway_refusal=spillway_refusal,
            region_bytes=chosen.region_bytes,
        ))
    return out, _stage_notes(out)


def _stage_notes(stages: list[dict[str, Any]]) -> list[str]:
    """Where vLLM's offloader sizes the stages differently: its scheduler-side manager
    counts stage 0's chunks, each stage's workers cut their own rows of the region."""
    rows = [(s["upstream"]["row_bytes"], s["upstream"]["num_chunks"]) for s in stages
            if s["upstream"] is not None]
    if len(set(rows)) <= 1:
        return []
    short = [s["stage"] for s in stages
             if s["upstream"] is not None and s["upstream"]["num_chunks"] < rows[0][1]]
    return [
        "vLLM's offloader sizes each stage's rows from that stage's KV cache: "
        f"(row bytes, chunks) per stage {rows}; its manager hands out stage 0's "
        f"{rows[0][1]} chunks"
        + (f", more than stage(s) {short} hold" if short else "")
        + ", and stages sharing a node share one /dev/shm region with different row "
        "strides (unchecked on GPUs; a split that gives every stage the same bytes per "
        "block avoids this)"
    ]


def _offload_request(
    request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> OffloadRequest:
    return OffloadRequest(
        cpu_bytes=cpu_bytes,
        world_size=workers,
        max_model_len=max_len,
        blocks_per_chunk=request.blocks_per_chunk,
        chunk_block_size_tokens=request.chunk_block_size_tokens,
        pipeline_parallel_size=request.pipeline_parallel_size,
        # vLLM dedups TP-replicated MLA rows only within one node's /dev/shm
        # (build_offloading_config: parallel_config.nnodes_within_dp == 1)
        single_node=_nodes_per_engine(request) == 1,
    )


def _nodes_per_engine(request: PlanRequest) -> int:
    """vLLM's ``nnodes_within_dp``: the nodes one engine's ranks span. With data
    parallelism across nodes each node holds whole engines (``_per_node``), so 1:
    ``nnodes // (data_parallel_size // data_parallel_size_local)`` = N // N."""
    return 1 if request.data_parallel_size > 1 else request.nodes


def _per_node(request: PlanRequest, workers: int, dp: int) -> tuple[int, int]:
    """(GPU workers of each engine on one node, engines on one node) when the replica
    spans ``request.nodes`` nodes (vLLM's --nnodes). Data-parallel size 1: the engine's
    tensor x pipeline ranks split evenly. Above 1 (DP attention, e.g. DP x EP MoE): each
    node holds DP / nodes whole engines (vLLM's --data-parallel-size-local), each
    engine's ranks on one node, as vLLM runs them (``nnodes_within_dp`` 1)."""
    nodes = request.nodes
    if nodes == 1:
        return workers, dp
    if dp > 1:
        if dp % nodes:
            raise PlanRefused(
                f"data parallel size {dp} does not split over {nodes} nodes: each node "
                "holds whole data-parallel engines (data_parallel_size / nodes), so the "
                "data-parallel size must be a multiple of the nodes"
            )
        return workers, dp // nodes
    if workers % nodes:
        raise PlanRefused(f"{nodes} nodes do not divide the engine's {workers} workers "
                          "(tensor x pipeline parallel) evenly")
    return workers // nodes, 1


def _pool_bytes(request: PlanRequest, workers: int, dp: int) -> int:
    """The host pool per engine: as asked, or the largest the memory limit allows
    (``workers`` and ``dp``: each engine's workers and the engines of one pod)."""
    cpu_bytes = request.cpu_memory_bytes
    if cpu_bytes is not None and request.host_memory_scope == "pod":
        cpu_bytes //= dp  # the pod's budget, one share per engine
    if cpu_bytes is None:
        if request.memory_limit_bytes is None:
            raise PlanRefused("give a CPU pool size (--cpu-memory) or a memory limit")
        cpu_bytes = max_pool_bytes(request.memory_limit_bytes, workers, dp)
    if cpu_bytes <= 0:
        raise PlanRefused("the CPU pool size must be positive")
    return cpu_bytes


def _geometries(
    layout: KVLayout, request: PlanRequest, cpu_bytes: int, workers: int, max_len: int
) -> tuple[UpstreamGeometry | None, str | None, SpillwayGeometry]:
    """Both offloaders' geometry for the pool. vLLM's may refuse the model; that only
    stops the plan when vLLM's offloader is the one asked for."""
    offload = _offload_request(request, cpu_bytes, workers, max_len)
    upstream: UpstreamGeometry | None = None
    refusal = None
    try:
        upstream = upstream_geometry(layout, offload)
    except OffloadRefused as e:
        if request.offloader == "upstream":
            raise
        refusal = str(e)
    if request.offloader == "spillway" and (why := spillway_connector_refusal(layout)):
        raise OffloadRefused(why)
    return upstream, refusal, spillway_geometry(layout, offload)


@dataclass(frozen=True)
class _ChosenOffload:
    """The figures of the offloader the engine will run (the plan's top level)."""

    blocks_per_chunk: int
    row_bytes: int
    num_chunks: int
    capacity_tokens: int
    region_bytes: int
    #: most keys the host manager can hold (one per row or unit)
    host_keys: int
    extra_config: dict[str, Any]
    transfer_config: dict[str, Any]


def _chosen_offload(
    offloader: str, upstream: UpstreamGeometry | None, spillway: SpillwayGeometry
) -> _ChosenOffload:
    if offloader == "upstream":
        assert upstream is not None  # _geometries raised otherwise
        extra = dict(upstream.kv_connector_extra_config)
        transfer: dict[str, Any] = {"kv_connector": UPSTREAM_CONNECTOR}
        figures = (
            upstream.blocks_per_chunk,
            upstream.row_bytes,
            upstream.num_chunks,
            upstream.capacity_tokens,
            upstream.region_bytes,
            upstream.num_chunks,
        )
    else:
        extra = dict(spillway.kv_connector_extra_config)
        transfer = {
            "kv_connector": SPILLWAY_CONNECTOR,
            "kv_connector_module_path": SPILLWAY_CONNECTOR_MODULE,
        }
        figures = (
            max(g.blocks_per_chunk for g in spillway.groups),
            spillway.chunk_set_bytes,
            spillway.num_chunks,
            spillway.capacity_tokens,
            spillway.region_bytes,
            spillway.num_units,
        )
    transfer.update(kv_role="kv_both", kv_connector_extra_config=extra)
    return _ChosenOffload(*figures, extra_config=extra, transfer_config=transfer)


def _sized_pod(
    region: int, workers: int, dp: int, memory_limit: int | None, host_keys: int = 0
) -> PodMemory:
    pod = size_pod(region, workers, dp, host_keys)
    if memory_limit is not None and pod.memory_limit_bytes > memory_limit:
        raise PlanRefused(
            f"the pod needs a memory limit of {pod.memory_limit_bytes} bytes (pool "
            f"{region} + processes {pod.process_overhead_bytes} + headroom), above the "
            f"given limit of {memory_limit}"
        )
    return pod


def _gpu_info(layout: KVLayout) -> dict[str, Any]:
    gpu = layout.gpu
    return dict(
        name=gpu.name,
        product=gpu.product,
        generation=gpu.generation,
        compute_capability=f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}",
        attention_backend=layout.attention_backend,
        gdn_prefill_kernel=layout.gdn_prefill_kernel or gpu.gdn_prefill_kernel(),
    )


def _kv_groups(layout: KVLayout) -> list[dict[str, Any]]:
    return [
        dict(
            kind=g.kind,
            num_layers=g.num_layers,
            layer_indices=list(g.layer_indices),
            tokens_per_block=g.tokens_per_block,
            page_bytes=g.page_bytes,
            bytes_per_block=g.bytes_per_block,
            sliding_window=g.sliding_window,
            attention_chunk_size=g.attention_chunk_size,
            padded_layers=g.padded_layers,
            layer_page_bytes=list(g.layer_page_bytes),
            prefix_cacheable=g.prefix_cacheable,
            backend=_group_backend(layout, g.kind),
        )
        for g in layout.groups
    ]


def _group_backend(layout: KVLayout, kind: str) -> str | None:
    """The backend a group's layers run on: the model's attention backend, or for state
    layers their family's kernels (GDN's prefill kernel, which sets the block grid, named)."""
    if kind != "mamba":
        return layout.attention_backend
    family = layout.shape.mamba.family if layout.shape.mamba is not None else "mamba"
    if layout.gdn_prefill_kernel is not None:
        return f"{family} ({layout.gdn_prefill_kernel} prefill)"
    return family


def _upstream_info(upstream: UpstreamGeometry) -> dict[str, Any]:
    return dict(
        blocks_per_chunk=upstream.blocks_per_chunk,
        copies=upstream.copies,
        replicated_layout=upstream.replicated_layout,
        row_bytes=upstream.row_bytes,
        num_chunks=upstream.num_chunks,
        region_bytes=upstream.region_bytes,
        capacity_tokens=upstream.capacity_tokens,
        gauge_tokens=upstream.gauge_tokens,
        groups=_chunks(upstream),
        kv_connector_extra_config=dict(upstream.kv_connector_extra_config),
    )


def _spillway_info(spillway: SpillwayGeometry) -> dict[str, Any]:
    return dict(
        chunk_tokens=spillway.chunk_tokens,
        copies=spillway.copies,
        unit_bytes=spillway.unit_bytes,
        num_units=spillway.num_units,
        groups=_chunks(spillway),
        row_layout=(
            "one pool of num_units units (rows of unit_bytes x copies); a chunk of group "
            "g takes units(g) of them, anywhere, so all groups share one LRU"
        ),
        chunk_set_bytes=spillway.chunk_set_bytes,
        num_chunks=spillway.num_chunks,
        region_bytes=spillway.region_bytes,
        capacity_tokens=spillway.capacity_tokens,
        gauge_tokens=spillway.gauge_tokens,
        kv_connector_extra_config=dict(spillway.kv_connector_extra_config),
    )
