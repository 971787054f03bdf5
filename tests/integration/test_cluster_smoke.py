"""The local control plane behaves like a GPU cluster: the real scheduler places GPU
pods on fake GPU nodes by their nvidia.com/gpu capacity, KWOK runs them with a
loopback pod IP, and the controller-manager garbage-collects owned objects."""

from __future__ import annotations

import ipaddress
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from kubernetes import client

from e2e.cluster.controlplane import free_port
from tests.helpers import wait_for

# Needs the local control plane harness itself (not an external cluster).
pytestmark = pytest.mark.local_only


def gpu_deployment(name: str, gpus: int, replicas: int = 1) -> client.V1Deployment:
    labels = {"app": name}
    container = client.V1Container(
        name="engine",
        image="example.invalid/engine:0",
        resources=client.V1ResourceRequirements(
            requests={"nvidia.com/gpu": str(gpus), "cpu": "1", "memory": "1Gi"},
            limits={"nvidia.com/gpu": str(gpus), "memory": "1Gi"},
        ),
    )
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[container]),
            ),
        ),
    )


def pods_of(core: client.CoreV1Api, ns: str, app: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(ns, label_selector=f"app={app}").items


def is_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_fake_gpu_nodes_advertise_gpus(api, cluster):
    nodes = client.CoreV1Api(api).list_node(label_selector="type=kwok").items
    assert len(nodes) == cluster.config.nodes
    for node in nodes:
        assert node.status.capacity["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.status.allocatable["memory"] == "2Ti"
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
        loopback = ipaddress.ip_network("127.0.0.0/8")
        assert ipaddress.ip_network(node.spec.pod_cidr).subnet_of(loopback)


def test_gpu_pod_is_scheduled_ready_on_loopback_ip(api, namespace):
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("one-gpu", gpus=1))

    pod = wait_for(
        lambda: next((p for p in pods_of(core, namespace, "one-gpu") if is_ready(p)), None),
        60,
        "the GPU pod to become Ready",
    )
    assert pod.spec.node_name.startswith("gpu-node-")
    scheduled = next(c for c in pod.status.conditions if c.type == "PodScheduled")
    assert scheduled.status == "True"
    node = core.read_node(pod.spec.node_name)
    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert ip.is_loopback
    assert ip in ipaddress.ip_network(node.spec.pod_cidr)

    # A local process bound to the pod IP stands in for the pod's container.
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello from " + self.server.server_address[0].encode())

        def log_message(self, *args):
            pass

    server = HTTPServer((pod.status.pod_ip, 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{pod.status.pod_ip}:{server.server_address[1]}/"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.read() == f"hello from {pod.status.pod_ip}".encode()
    finally:
        server.shutdown()
        server.server_close()


def test_pod_wanting_more_gpus_than_any_node_stays_pending(api, namespace):
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("too-big", gpus=9))

    def unschedulable():
        for pod in pods_of(core, namespace, "too-big"):
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return pod, cond
        return None

    pod, cond = wait_for(unschedulable, 60, "the scheduler to refuse the 9-GPU pod")
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    assert "Insufficient nvidia.com/gpu" in cond.message
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod.metadata.name}"
    ).items
    assert any(e.reason == "FailedScheduling" for e in events)


def test_gpus_are_bin_packed_until_capacity_runs_out(api, namespace, cluster):
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    # 4-GPU pods: two fit on each 8-GPU node; one more than that must wait.
    fit = 2 * cluster.config.nodes
    apps.create_namespaced_deployment(namespace, gpu_deployment("four", gpus=4, replicas=fit + 1))

    def settled():
        pods = pods_of(core, namespace, "four")
        ready = [p for p in pods if is_ready(p)]
        pending = [p for p in pods if p.status.phase == "Pending" and not p.spec.node_name]
        return (ready, pending) if len(ready) == fit and len(pending) == 1 else None

    ready, _ = wait_for(settled, 90, f"{fit} ready 4-GPU pods and one pending")
    per_node: dict[str, int] = {}
    for pod in ready:
        per_node[pod.spec.node_name] = per_node.get(pod.spec.node_name, 0) + 1
    assert sorted(per_node.values()) == [2] * cluster.config.nodes
    assert len({p.status.pod_ip for p in ready}) == fit


def test_deleting_a_deployment_garbage_collects_its_pods(api, namespace):
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("gc", gpus=1, replicas=2))
    wait_for(lambda: len([p for p in pods_of(core, namespace, "gc") if is_ready(p)]) == 2, 60,
             "two Ready pods")
    apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Background")
    wait_for(lambda: not pods_of(core, namespace, "gc"), 60, "the pods to be garbage-collected")


def test_a_pod_status_write_refused_with_a_500_is_written_again(api, namespace, cluster):
    """KWOK stands in for the kubelet, which writes a refused pod status again. KWOK
    0.8.0 gives up on a 500 (the API server's answer to a write in flight when etcd is
    SIGKILLed) and leaves the pod Pending for good: the etcd fault test's flake. The
    build retries 500s (tools/build.sh); here a webhook that cannot be reached answers
    every status write of this namespace with a 500 until it is deleted."""
    admission, core = client.AdmissionregistrationV1Api(api), client.CoreV1Api(api)
    webhook = client.V1ValidatingWebhookConfiguration(
        metadata=client.V1ObjectMeta(name=f"refuse-pod-status-{namespace}"),
        webhooks=[client.V1ValidatingWebhook(
            name="refuse.pod-status.spillway.dev",
            client_config=client.AdmissionregistrationV1WebhookClientConfig(
                url=f"https://127.0.0.1:{free_port()}/"),  # nothing listens: a 500
            rules=[client.V1RuleWithOperations(operations=["UPDATE"], api_groups=[""],
                                               api_versions=["v1"], resources=["pods/status"])],
            namespace_selector=client.V1LabelSelector(
                match_labels={"kubernetes.io/metadata.name": namespace}),
            failure_policy="Fail", side_effects="None", admission_review_versions=["v1"],
            timeout_seconds=2)])
    admission.create_validating_webhook_configuration(webhook)
    try:
        # In force before KWOK sees a pod: a pod bound to no node of KWOK's proves it.
        probe = client.V1Pod(metadata=client.V1ObjectMeta(name="probe"), spec=client.V1PodSpec(
            node_name="no-such-node", containers=[client.V1Container(name="c", image="x")]))
        core.create_namespaced_pod(namespace, probe)

        def refused() -> bool:
            try:
                core.patch_namespaced_pod_status(
                    "probe", namespace, {"status": {"conditions": [
                        {"type": "Probe", "status": "True"}]}})
            except client.ApiException as e:
                assert e.status == 500, e.body
                return True
            return False

        wait_for(refused, 30, "the webhook refusing pod status writes")
        # No kubelet will confirm its deletion: removed at once, not left to the pod GC.
        core.delete_namespaced_pod("probe", namespace, grace_period_seconds=0)
        client.AppsV1Api(api).create_namespaced_deployment(
            namespace, gpu_deployment("refused", gpus=1))
        log = cluster.workdir / "logs" / "kwok.log"

        def kwok_was_refused() -> bool:
            pods = pods_of(core, namespace, "refused")
            return bool(pods) and any(
                pods[0].metadata.name in line and "failed to apply stage" in line
                for line in log.read_text().splitlines())

        wait_for(kwok_was_refused, 60, "KWOK's status write for the pod refused with a 500")
        assert not is_ready(pods_of(core, namespace, "refused")[0])
    finally:
        admission.delete_validating_webhook_configuration(webhook.metadata.name)
    wait_for(lambda: any(is_ready(p) for p in pods_of(core, namespace, "refused")), 60,
             "the pod Ready once status writes are accepted again")


def test_pod_ip_is_bindable_locally():
    # Guard for the whole approach: the kernel routes all of 127/8 to lo.
    with socket.socket() as s:
        s.bind(("127.2.0.250", 0))
        assert s.getsockname()[0] == "127.2.0.250"
