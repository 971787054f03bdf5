"""Whether a replica can be split over its nodes as vLLM runs it (pure checks on the
spec; the reconciler reports a refusal as PlanReady=False)."""

from __future__ import annotations

from spillway_operator.flow.spec import InferenceDeploymentSpec


def placement_refusal(spec: InferenceDeploymentSpec) -> str | None:
    """Why the replica cannot be split over its nodes as vLLM runs it, or None."""
    e, nodes = spec.engine, spec.nodes
    if nodes > 1 and e.data_parallel_size > 1:
        return _data_parallel_refusal(spec)
    if e.pipeline_parallel_size > 1 and nodes != e.pipeline_parallel_size:
        # vLLM maps one offload region per instance on each node; stages sharing a node
        # would share it with different row strides (unchecked): one stage per node.
        return (f"spec.engine.nodes: pipeline stages are served one per node; set "
                f"engine.nodes to pipelineParallelSize ({e.pipeline_parallel_size}), "
                f"not {nodes}")
    if nodes == 1:
        return None
    if spec.gpus_per_replica % nodes:
        return (f"spec.engine.nodes: {nodes} nodes do not divide the replica's "
                f"{spec.gpus_per_replica} GPUs (tensorParallelSize x "
                "pipelineParallelSize) evenly")
    if spec.gpus_per_pod > spec.resources.gpus_per_node:
        return (f"spec.engine.nodes: {spec.gpus_per_pod} GPUs per node are more than "
                f"resources.gpusPerNode ({spec.resources.gpus_per_node})")
    return None


def _data_parallel_refusal(spec: InferenceDeploymentSpec) -> str | None:
    """Data parallelism across nodes (DP attention, e.g. DP x EP MoE): every node
    holds dataParallelSize / nodes whole engines, each engine's GPUs on its node, as
    vLLM's --data-parallel-size-local runs them."""
    e, nodes = spec.engine, spec.nodes
    dp, per_node = e.data_parallel_size, spec.resources.gpus_per_node
    if dp % nodes:
        return (f"spec.engine.dataParallelSize: {dp} data-parallel engines do not split "
                f"over {nodes} nodes; each node holds whole engines, so "
                "dataParallelSize must be a multiple of engine.nodes")
    if e.pipeline_parallel_size > 1:
        return ("spec.engine.pipelineParallelSize: with dataParallelSize above 1 across "
                "nodes each engine runs on one node, where its pipeline stages would "
                "share one offload region; use pipelineParallelSize 1")
    engine_gpus = e.tensor_parallel_size * e.pipeline_parallel_size
    if engine_gpus * (dp // nodes) > per_node:
        return (f"spec.engine.nodes: {dp // nodes} engines of {engine_gpus} GPUs on each "
                f"of {nodes} nodes are {engine_gpus * (dp // nodes)} GPUs a node, more "
                f"than resources.gpusPerNode ({per_node})")
    return None
