"""GPU node pools: one object served on several GPU products (spec.resources.gpuPools).

Each pool is the object's spec as that pool runs it (its GPU product, its nodes, its
share of the replicas), planned and rendered like an object of its own: its own plan
ConfigMap, workload and pod size. The Service, InferencePool, PodDisruptionBudget,
spillway-router and the autoscaler select every pool's pods by the object's labels.

Pure functions only: the reconciler reads nodes and applies the results.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spillway_engine.planner.gpus import GPUS, Gpu, UnknownGpu, get_gpu, gpu_for_product_label
from spillway_engine.planner.plan import PlanRequest
from spillway_operator.flow.spec import GpuPoolSpec, InferenceDeploymentSpec
from spillway_operator.names import GROUP

#: The label on a pool's pods (and its workload's selector): the pool's name.
POOL_LABEL = f"{GROUP}/gpu-pool"
#: GPU Feature Discovery's labels on a GPU node.
GFD_PRODUCT = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class PoolView:
    """One workload of an object: ``name`` None for an object without gpuPools (its
    one workload keeps the object's name), else the pool's."""

    name: str | None
    spec: InferenceDeploymentSpec
    #: pods of every pool that may write a shared disk tier at once (the object's)
    disk_writers: int = 1

    def plan_request(self) -> PlanRequest:
        return self.spec.plan_request().model_copy(update={"disk_writers": self.disk_writers})


def split_replicas(total: int, pools: Iterable[GpuPoolSpec]) -> list[int]:
    """spec.replicas over the pools: each pool its minReplicas first (in order, while
    replicas last), then one at a time to the pool furthest below its weight's share
    (Sainte-Lague's highest averages; ties to the first), none beyond its maxReplicas.
    Replicas beyond every pool's maxReplicas are not run (``unplaced``)."""
    pools = list(pools)
    counts = [0] * len(pools)
    left = total
    for i, pool in enumerate(pools):
        counts[i] = min(pool.min_replicas, pool.max_replicas, left)
        left -= counts[i]
    while left > 0:
        open_ = [i for i, p in enumerate(pools) if counts[i] < p.max_replicas]
        if not open_:
            break
        # Sainte-Lague: the pool whose share, one more replica counted half, is lowest
        i = min(open_, key=lambda j: ((2 * counts[j] + 1) / pools[j].weight, j))
        counts[i] += 1
        left -= 1
    return counts


def unplaced(spec: InferenceDeploymentSpec) -> int:
    """Replicas spec.replicas asks for beyond what the pools' maxReplicas allow."""
    pools = spec.resources.gpu_pools
    return 0 if not pools else spec.replicas - sum(split_replicas(spec.replicas, pools))


def removals(spec: InferenceDeploymentSpec, current: int, desired: int) -> dict[str, int]:
    """A scale-down from ``current`` to ``desired`` replicas: the replicas each pool's
    workload gives up (the pools whose share shrinks), for the autoscaler to mark
    pods of those pools only."""
    pools = spec.resources.gpu_pools or []
    before, after = split_replicas(current, pools), split_replicas(desired, pools)
    return {p.name: b - a for p, b, a in zip(pools, before, after, strict=True) if b > a}


def pool_views(spec: InferenceDeploymentSpec) -> list[PoolView]:
    """The object's workloads: itself, or one per pool with its share of the replicas."""
    pools = spec.resources.gpu_pools
    if not pools:
        return [PoolView(None, spec, spec.disk_writers)]
    views = []
    for pool, replicas in zip(pools, split_replicas(spec.replicas, pools), strict=True):
        selector = {**(spec.resources.node_selector or {}), **(pool.node_selector or {})}
        resources = spec.resources.model_copy(update={
            "gpu_product": pool.gpu_product, "node_selector": selector or None,
            "gpu_pools": None})
        views.append(PoolView(pool.name, spec.model_copy(
            update={"replicas": replicas, "resources": resources}), spec.disk_writers))
    return views


def known_gpus() -> str:
    return ", ".join(f"{g.name} ({g.product})" for g in GPUS.values())


def unknown_product_refusal(spec: InferenceDeploymentSpec, pool: str | None) -> str | None:
    """PlanReady's message for a GPU product the catalogue does not know, or None."""
    product = spec.resources.gpu_product
    try:
        get_gpu(product)
    except UnknownGpu:
        where = "spec.resources.gpuProduct" if pool is None else f"gpuPools[{pool}].gpuProduct"
        return (f"{where}: {product!r} is not a GPU Spillway plans for (its plan depends on "
                f"the GPU's kernels and memory); known: {known_gpus()}")
    return None


def product_labels(spec: InferenceDeploymentSpec) -> list[str]:
    """GFD's nvidia.com/gpu.product values of the spec's GPU product."""
    return list(get_gpu(spec.resources.gpu_product).gfd_products)


def node_selector_string(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def mixed_products(view: PoolView, nodes: Iterable[Mapping[str, Any]]) -> str | None:
    """The nodes a pool's nodeSelector matches that carry another GPU product than the
    pool's (its pods are pinned to its own product's nodes, so those nodes go unused),
    as a message naming them; None when all match or none carry a product label."""
    gpu: Gpu = get_gpu(view.spec.resources.gpu_product)
    others: dict[str, list[str]] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        label = (meta.get("labels") or {}).get(GFD_PRODUCT)
        if label is None or label in gpu.gfd_products:
            continue
        known = gpu_for_product_label(label)
        product = label if known is None else f"{label} ({known.name})"
        others.setdefault(product, []).append(meta.get("name", "?"))
    if not others:
        return None
    selector = node_selector_string(view.spec.resources.node_selector or {})
    listed = "; ".join(f"{p} on {', '.join(sorted(n)[:5])}" + (
        f" and {len(n) - 5} more" if len(n) > 5 else "") for p, n in sorted(others.items()))
    where = "resources.nodeSelector" if view.name is None else f"gpuPools[{view.name}]"
    return (f"{where} {selector} matches nodes of other GPU products than {gpu.name}: "
            f"{listed}; the pods run on the {gpu.name} nodes only (a plan is made for one "
            "GPU product: give each product its own pool)")
