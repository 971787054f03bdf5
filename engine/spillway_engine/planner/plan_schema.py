"""The plan's types: what a deployment asks for (:class:`PlanRequest`), the one typed
:class:`Plan` every consumer reads (its JSON is what ``spillway plan --format json``
prints and the operator publishes), and :class:`PlanRefused`. ``plan.make_plan``
makes a plan; ``plan_reader.read_plan`` is its only JSON reader.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spillway_engine.planner.gpus import DEFAULT_CUDA_MAJOR, DEFAULT_GPU


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
    pool_bounding_stage: int | None = Field(
        None,
        description="The pipeline stage whose host pool holds the fewest chunks: Spillway's "
        "offloader hands out only what it holds, on every stage; null where the stages' "
        "pools agree (no pipeline parallelism, or stages of equal bytes per block).",
    )

    @cached_property
    def file_text(self) -> str:
        """The plan file the engine reads. Sorted keys keep the text, and so
        :attr:`file_hash`, stable for an unchanged plan (a changed hash rolls the pods).
        Kept on the (frozen) plan: the operator asks for it several times a reconcile."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)

    @cached_property
    def file_hash(self) -> str:
        return hashlib.sha256(self.file_text.encode()).hexdigest()[:16]

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Plan:
        # pydantic copies the instance dict, cached text included: a changed copy drops it
        copy = super().model_copy(update=update, deep=deep)
        for cached in ("file_text", "file_hash"):
            copy.__dict__.pop(cached, None)
        return copy

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
