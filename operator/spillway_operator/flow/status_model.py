"""The typed model of the InferenceDeployment status: what ``flow.status`` builds and
the CRD's status schema (``flow.crd``) is generated from."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from spillway_operator.flow.spec import _Model


class ConditionType(StrEnum):
    PLAN_READY = "PlanReady"
    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    #: a GPU pool's nodeSelector matches nodes of other GPU products (present only when
    #: a pool has a nodeSelector and the operator may list nodes)
    MIXED_GPU_PRODUCTS = "MixedGPUProducts"


class Condition(_Model):
    type: str
    status: Annotated[str, Field(pattern=r"^(True|False|Unknown)$")]
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    message: str = ""
    last_transition_time: Annotated[str, Field(json_schema_extra={"format": "date-time"})]
    observed_generation: int | None = None


class KVGroupSummary(_Model):
    kind: str
    num_layers: int
    tokens_per_block: int
    page_bytes: int
    sliding_window: int | None = None


class PlanSummary(_Model):
    """What the planner decided; the full plan is in the ConfigMap the engine mounts."""

    offloader: str | None = None
    gpu: str | None = None
    gpus_per_pod: int | None = None
    nodes: Annotated[int | None, Field(description="pods (nodes) per replica; above 1 the "
                                       "replicas are LeaderWorkerSet groups")] = None
    kv_groups: list[KVGroupSummary] = Field(default_factory=list)
    tokens_per_hash: int | None = None
    blocks_per_chunk: int | None = None
    chunk_tokens: int | None = None
    host_pool_bytes: int | None = None
    host_pool: Annotated[str | None, Field(description="host pool per pod, human-readable")] = None
    host_pool_bytes_per_engine: Annotated[
        int | None, Field(description="each data-parallel engine's host pool")] = None
    host_memory_scope: Annotated[
        str | None, Field(description="whether spec.offload.hostMemory was read per engine "
                          "or per pod")] = None
    num_chunks: int | None = None
    capacity_tokens: int | None = None
    shm_bytes: int | None = None
    memory_request_bytes: int | None = None
    memory_limit_bytes: int | None = None
    disk_budget_bytes_per_engine: Annotated[
        int | None, Field(description="the disk tier's chunk files, at most, per engine")] = None
    disk_capacity_tokens: Annotated[
        int | None, Field(description="prefix tokens the disk tier holds per engine")] = None
    hash: Annotated[str | None, Field(description="digest of the plan the pods run")] = None


class PoolStatus(_Model):
    """One GPU pool of spec.resources.gpuPools: its share of the replicas and its plan."""

    name: str
    gpu_product: str
    workload: Annotated[str, Field(description="its Deployment or LeaderWorkerSet")]
    replicas: Annotated[int, Field(description="its share of spec.replicas")] = 0
    ready_replicas: int = 0
    plan: PlanSummary | None = None


class AutoscalingStatus(_Model):
    pressure: float | None = None
    components: Annotated[
        dict[str, float] | None,
        Field(json_schema_extra={"type": "object", "additionalProperties": {"type": "number"}}),
    ] = None
    measured_pods: Annotated[
        int | None, Field(description="ready pods whose pressure was measured")] = None
    unmeasured_pods: Annotated[
        int | None, Field(description="ready pods whose /metrics could not be used")] = None
    metrics_problems: Annotated[
        list[str] | None, Field(description="why, for the first few of them")] = None
    desired_replicas: int | None = None
    last_decision: str | None = None
    last_decision_reason: str | None = None
    last_decision_term: Annotated[
        str | None,
        Field(description="the pressure term behind the last decision: throughput, load, "
              "queue, thrash or preempt; forecast:<term> when the trend of that term's "
              "demand asked for more; bounds when min/maxReplicas set it")] = None
    serving_rate: Annotated[
        dict[str, float] | None,
        Field(description="a replica's serving rate as the throughput term uses it, "
              "learned from the pods' metrics (the plan's roofline until they show it)",
              json_schema_extra={"type": "object", "additionalProperties": {"type": "number"}}),
    ] = None
    last_scale_time: Annotated[str | None, Field(json_schema_extra={"format": "date-time"})] = None


class DiskTierStatus(_Model):
    """Disk-tier stores failing (volume full, read-only, failing); absent while they work."""

    # Written by the autoscaler from the pods' scraped counters (flow.disk_health).

    failing_pods: Annotated[
        list[str] | None, Field(description="pods whose disk-tier stores fail: their "
                                "failures grew within the hold window and no store "
                                "succeeded since")] = None
    write_failures: Annotated[
        int | None, Field(description="failed disk-tier stores over all pods in the last "
                          "interval")] = None


class Routing(StrEnum):
    """What routes requests to the engine pods (status.routing)."""

    SPILLWAY_ROUTER = "SpillwayRouter"
    INFERENCE_POOL = "InferencePool"


class InferenceDeploymentStatus(_Model):
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    selector: Annotated[str | None, Field(description="label selector of the pods (scale)")] = None
    conditions: list[Condition] = Field(default_factory=list)
    plan: Annotated[PlanSummary | None, Field(description="the plan (with gpuPools: the "
                                              "first pool's; each is in pools)")] = None
    pools: Annotated[list[PoolStatus] | None, Field(
        description="spec.resources.gpuPools: each pool's replicas and plan")] = None
    autoscaling: AutoscalingStatus | None = None
    disk_tier: DiskTierStatus | None = None
    routing: Annotated[
        Routing | None,
        Field(description="InferencePool: an InferencePool of this name selects the engine "
              "pods for a Gateway API Inference Extension gateway, with Spillway's endpoint "
              "picker; SpillwayRouter: none (no --endpoint-picker given to the operator, or "
              "the cluster does not serve inference.networking.k8s.io/v1 InferencePools), "
              "clients use spillway-router or the Service"),
    ] = None
