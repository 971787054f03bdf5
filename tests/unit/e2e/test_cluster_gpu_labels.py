"""The local clusters' fake GPU nodes carry GPU Feature Discovery's labels of any
catalogue GPU, per node, for KWOK nodes and real nodes alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster.__main__ import main as cluster_main
from e2e.cluster.controlplane import ClusterConfig, LocalCluster, Ports
from e2e.cluster.gfd import gfd_labels
from e2e.nodes.realnodes import RealNodes
from spillway_engine.planner.gpus import GPUS, gpu_for_product_label
from spillway_operator.flow.pools import mixed_products, pool_views
from spillway_operator.flow.spec import InferenceDeploymentSpec


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_every_catalogue_gpu_gets_gfds_labels(gpu):
    labels = gfd_labels(gpu, 8)
    entry = GPUS[gpu]
    assert gpu_for_product_label(labels["nvidia.com/gpu.product"]) is entry
    assert (int(labels["nvidia.com/gpu.compute.major"]),
            int(labels["nvidia.com/gpu.compute.minor"])) == entry.compute_capability
    assert int(labels["nvidia.com/gpu.memory"]) == entry.memory_bytes // 2**20
    assert labels["nvidia.com/gpu.count"] == "8"


def test_a_gfd_label_is_kept_as_given_and_memory_may_be_nvidia_smis():
    labels = gfd_labels("NVIDIA-H100-NVL", 4, memory_mib=95830)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-NVL"
    assert labels["nvidia.com/gpu.memory"] == "95830"


def config(**fields) -> ClusterConfig:
    return ClusterConfig(workdir=Path("/nonexistent"), ports=Ports.from_base(20000), **fields)


def test_a_cluster_of_one_h100_node_and_one_of_another_product():
    """The shape issue 43's acceptance runs on: an H100 node and a second product's."""
    nodes = LocalCluster(config(nodes=2, gpu_products=("h100", "a100"))).node_manifests()
    products = [n["metadata"]["labels"]["nvidia.com/gpu.product"] for n in nodes]
    assert [gpu_for_product_label(p).name for p in products] == ["h100", "a100"]
    assert [n["spec"]["podCIDR"] for n in nodes] == ["127.1.0.0/24", "127.1.1.0/24"]
    # A pool selecting both sees the other product named.
    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "google/gemma-3-1b-it"},
        "resources": {"gpuProduct": "h100", "nodeSelector": {"type": "kwok"}}})
    message = mixed_products(pool_views(spec)[0], nodes)
    assert message is not None and "(a100) on gpu-node-1;" in message


def test_nodes_past_the_list_and_the_default_keep_the_h100_label_as_before():
    nodes = LocalCluster(config(nodes=3, gpu_products=("b200",))).node_manifests()
    labels = [n["metadata"]["labels"] for n in nodes]
    assert labels[0]["nvidia.com/gpu.product"] == "NVIDIA-B200"
    assert labels[0]["nvidia.com/gpu.compute.major"] == "10"
    assert [x["nvidia.com/gpu.product"] for x in labels[1:]] == ["NVIDIA-H100-80GB-HBM3"] * 2
    assert [x["nvidia.com/gpu.memory"] for x in labels[1:]] == ["81559"] * 2


def test_real_nodes_get_their_own_products():
    cluster = LocalCluster(config(nodes=0, real_nodes=2, real_node_products=("h100", "l40s")))
    nodes = RealNodes(cluster).node_manifests()
    assert [gpu_for_product_label(n["metadata"]["labels"]["nvidia.com/gpu.product"]).name
            for n in nodes] == ["h100", "l40s"]
    assert nodes[1]["metadata"]["labels"]["nvidia.com/gpu.compute.minor"] == "9"


def test_the_cluster_command_refuses_a_gpu_it_does_not_know(capsys):
    with pytest.raises(SystemExit) as exit_:
        cluster_main(["status", "--gpu-product", "h100,x900"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'x900'" in err and "b200" in err
