"""GPU Feature Discovery's node labels for a fake GPU node of any catalogue GPU.

The local clusters' nodes (KWOK and real) carry the labels NVIDIA's GFD puts on a real
GPU node, from the planner's catalogue (``spillway_engine.planner.gpus``), so the
operator selects them exactly as it selects real ones.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.gpus import get_gpu, gpu_for_product_label

PRODUCT = "nvidia.com/gpu.product"


def gfd_labels(product: str, gpus: int, memory_mib: int | None = None) -> dict[str, str]:
    """GFD's labels for ``gpus`` GPUs of ``product``: a catalogue name (``h100``,
    ``b200``), an alias, or a GFD product label (kept as given). ``memory_mib``
    overrides the catalogue's memory (nvidia-smi's figure, e.g. 81559 for an H100)."""
    gpu = get_gpu(product)  # UnknownGpu names the known ones
    label = product if gpu_for_product_label(product) is gpu else gpu.gfd_products[0]
    major, minor = gpu.compute_capability
    return {
        "nvidia.com/gpu.present": "true",
        PRODUCT: label,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(memory_mib or gpu.memory_bytes // 2**20),
        "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor),
        "nvidia.com/gpu.family": gpu.generation,
    }


def product_of(products: tuple[str, ...], default: str, index: int) -> str:
    """Node ``index``'s product: its entry in ``products``, else ``default``."""
    return products[index] if index < len(products) else default


def node_gpu_labels(c: Any, products: tuple[str, ...], index: int) -> dict[str, str]:
    """GFD's labels for node ``index`` of a list of per-node products (``c``: the cluster's
    config, whose ``gpu_product`` and ``gpu_memory_mib`` are the default node's)."""
    product = product_of(products, c.gpu_product, index)
    memory = c.gpu_memory_mib if product == c.gpu_product else None
    return gfd_labels(product, c.gpus_per_node, memory)
