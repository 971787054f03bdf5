"""Quiet when nothing changes: against the real control plane and the operator process,
objects in every state a user can leave them in (a multi-node group among them) are
watched for several autoscaler intervals and a resync while the operator's request log
counts its writes. Once each status is right the operator writes nothing (no status
PATCH, no Event, no child), and a namespace being deleted draws no write at all.

The operator fixture logs every API request it sends ("PATCH /apis/... HTTP/1.1" 200),
so the writes into a namespace are counted from its log, by namespace."""

from __future__ import annotations

import re
import time
import uuid

import pytest
from kubernetes import client

from tests.helpers import fresh_namespace, wait_for
from tests.integration.conftest import SECOND
from tests.integration.test_hostile import GOOD, serve_metrics
from tests.integration.test_operator import Env, infdep, model_configmap

pytestmark = [pytest.mark.usefixtures("operator"), pytest.mark.local_only]

#: The fixture's operator resyncs every 20 s (SPILLWAY_RESYNC_SECONDS): the quiet
#: window holds one resync, some twenty autoscaler ticks and the back-off retries of
#: the object whose config is missing.
QUIET_SECONDS = 25
BAD_METRICS = b"vllm:num_requests_running 1\n" * (5 * 2**20 // 28)  # over the 4 MiB cap
READY = "spillway.dev/harness-ready"  # KWOK's pods in gated-* namespaces turn Ready on it


def writes_into(log: str, namespaces: set[str]) -> list[str]:
    """The write requests (any verb but GET) into ``namespaces`` in the log text."""
    found = []
    for m in re.finditer(r'"(POST|PUT|PATCH|DELETE) (/[^ "]*) HTTP/1\.1" \d+', log):
        ns = re.search(r"/namespaces/([^/?]+)/", m.group(2))
        if ns and ns.group(1) in namespaces:
            found.append(m.group(0))
    return found


@pytest.fixture
def gated(api):
    """Pods that run unready until the test (standing in for the kubelet) says more."""
    with fresh_namespace(api, f"gated-quiet-{uuid.uuid4().hex[:6]}") as name:
        yield name


def _pod_ips(env: Env, name: str, count: int) -> dict[str, str]:
    def ips():
        pods = [p for p in env.core.list_namespaced_pod(
            env.ns, label_selector=f"spillway.dev/inference-deployment={name}").items
            if p.status.pod_ip and not p.metadata.deletion_timestamp]
        return {p.status.pod_ip: p.metadata.name for p in pods} if len(pods) == count else None

    return wait_for(ips, 60, f"{count} pod IPs of {name}")


def _never_starts(env: Env, name: str, reason: str, message: str) -> str:
    """Write the pod's status as a kubelet does for a container it cannot start."""
    (pod,) = wait_for(lambda: [p for p in env.core.list_namespaced_pod(
        env.ns, label_selector=f"spillway.dev/inference-deployment={name}").items
        if p.status.phase == "Running"] or None, 60, f"{name}'s pod running")
    containers = [{"name": c.name, "image": c.image, "imageID": "", "ready": False,
                   "started": False, "restartCount": 0,
                   "state": {"waiting": {"reason": reason, "message": message}}}
                  for c in pod.spec.containers]
    env.core.patch_namespaced_pod_status(pod.metadata.name, env.ns,
                                         {"status": {"containerStatuses": containers}})
    return pod.metadata.name


def test_steady_state_writes_nothing_in_every_state(api, cluster, operator, second_node,
                                                   namespace, gated):
    env, genv = Env(api, namespace, cluster), Env(api, gated, cluster)
    model_configmap(env.core, namespace, "model", "gemma-3-1b-it.json")
    model_configmap(genv.core, gated, "model", "gemma-3-1b-it.json")
    autoscaling = {"enabled": True, "minReplicas": 2, "maxReplicas": 2, "intervalSeconds": 1}
    env.create(infdep("healthy", replicas=2, autoscaling=autoscaling))
    env.create(infdep("recovered", replicas=2, autoscaling=autoscaling))
    env.create(infdep("refused", host_memory="1Ki"))
    env.create(infdep("no-config", config_map="absent"))
    genv.create(infdep("never-starts"))
    # Two GPU pools, the second of another product on its own node, and a node pool
    # of mixed products (MixedGPUProducts): as quiet as the rest.
    env.create(infdep("pools", replicas=2, resources={"gpuPools": [
        {"name": "hopper", "gpuProduct": "h100"}, {"name": "second", "gpuProduct": SECOND}]}))
    env.create(infdep("mixed", resources={"nodeSelector": {"type": "kwok"}}))
    # A replica across two nodes: one LeaderWorkerSet group, which the operator watches
    # rather than reads at every reconcile.
    env.create(infdep("groups", engine={"tensorParallelSize": 1, "pipelineParallelSize": 2,
                                        "nodes": 2}))

    healthy = _pod_ips(env, "healthy", 2)
    recovered = _pod_ips(env, "recovered", 2)
    ips = sorted(recovered)
    servers = [serve_metrics(ip, GOOD) for ip in healthy] + [
        serve_metrics(ips[0], GOOD), serve_metrics(ips[1], BAD_METRICS)]
    try:
        # One pod's metrics are unusable: it is named in status.autoscaling...
        # (A tick before the test's metrics servers listen names a connection error.)
        def problems():
            a = (env.get("recovered").get("status") or {}).get("autoscaling") or {}
            said = a.get("metricsProblems") or [""]
            return a if a.get("unmeasuredPods") == 1 and "body over" in said[0] else None

        named = wait_for(problems, 30, "the unmeasured pod named",
                         on_timeout=lambda: env.get("recovered").get("status"))
        assert named["metricsProblems"][0].startswith(recovered[ips[1]] + ": body over")
        # ... and once they recover, it is cleared, not kept for ever.
        servers[-1].body = GOOD

        def cleared():
            a = (env.get("recovered").get("status") or {}).get("autoscaling") or {}
            return a if a.get("measuredPods") == 2 else None

        a = wait_for(cleared, 30, "the problem cleared",
                     on_timeout=lambda: env.get("recovered").get("status"))
        assert "unmeasuredPods" not in a and "metricsProblems" not in a, a

        # The kubelet cannot start the gated pod's container: Degraded, with its reason.
        pod = _never_starts(genv, "never-starts", "InvalidImageName",
                            'Failed to apply default image tag "x": couldn\'t parse image '
                            "name: invalid reference format")
        degraded = genv.wait_condition("never-starts", "Degraded", "True", "PodsFailing")
        assert degraded["message"].startswith(f"pod {pod}: InvalidImageName: Failed to apply")
        env.wait_condition("refused", "PlanReady", "False", "OffloadPlanInvalid")
        env.wait_condition("no-config", "PlanReady", "False", "ModelConfigUnavailable")
        env.wait_condition("pools", "Available", "True")
        env.wait_condition("mixed", "MixedGPUProducts", "True", "MixedGPUProducts")
        env.wait_condition("groups", "Available", "True")
        for name in ("healthy", "recovered"):
            env.wait_condition(name, "Available", "True")
            wait_for(lambda n=name: ((env.get(n).get("status") or {}).get("autoscaling")
                                     or {}).get("measuredPods") == 2, 30, f"{name} measured")
        # The autoscaler's first word on the others ("autoscaling is off"): a new object's
        # first tick comes up to one interval (15 s by default) after its first reconcile.
        for e, name in ((env, "refused"), (env, "no-config"), (genv, "never-starts"),
                        (env, "pools"), (env, "mixed"), (env, "groups")):
            wait_for(lambda e=e, n=name: (e.get(n).get("status") or {}).get("autoscaling"),
                     30, f"{name}'s status.autoscaling")
        time.sleep(3)  # the last ticks' writes of the states just reached

        start, hits = len(operator.log_text()), sum(s.hits for s in servers)
        time.sleep(QUIET_SECONDS)
        log = operator.log_text()[start:]
        writes = writes_into(log, {namespace, gated})
        # The operator's own words on a write it retried (e.g. the API server's reason for
        # a 422) say why, where the access log only says that.
        said = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
        assert writes == [], "\n".join(writes[:20] + said[:20])
        # It was looking all along: the scrapes went on, and so did the retries.
        assert sum(s.hits for s in servers) - hits >= 2 * QUIET_SECONDS
        assert re.search(rf'"GET /api/v1/namespaces/{namespace}/configmaps/absent ', log)
        # The converged group's LeaderWorkerSet comes from the watch, not a GET per
        # reconcile (the resync's included) or per autoscaler tick.
        reads = re.findall(rf'"GET /apis/leaderworkerset\.x-k8s\.io/v1/namespaces/{namespace}/'
                           r'leaderworkersets/[^ "]*', log)
        assert reads == [], reads[:5]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_namespace_being_deleted_draws_no_write(api, cluster, operator):
    """Its children go first, its pods stop answering /metrics: before the operator
    knew the namespace was going from the namespaces' watch, those news drew status
    PATCHes and Warning Events until a create was refused as "being terminated"."""
    ns = f"quiet-delete-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    env = Env(api, ns, cluster)
    model_configmap(env.core, ns, "model", "gemma-3-1b-it.json")
    servers = []
    try:
        for i in range(3):
            env.create(infdep(f"obj-{i}", replicas=2, autoscaling={
                "enabled": True, "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 1}))
        for i in range(3):
            servers += [serve_metrics(ip, GOOD) for ip in _pod_ips(env, f"obj-{i}", 2)]
        for i in range(3):
            env.wait_condition(f"obj-{i}", "Available", "True")
        time.sleep(3)
        start = len(operator.log_text())
        core.delete_namespace(ns)
        for s in servers:  # the pods' engines go with them
            s.shutdown()
            s.server_close()
        servers = []
        wait_for(lambda: not [n for n in core.list_namespace().items
                              if n.metadata.name == ns], 90, f"{ns} to go")
        time.sleep(3)
        writes = writes_into(operator.log_text()[start:], {ns})
        assert writes == [], "\n".join(writes[:20])
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_namespace_deleted_mid_rollout_draws_no_write(api, cluster, operator):
    """Objects mid-rollout (a new plan's pods unready beside the old ready ones) when
    their namespace is deleted: no write into it once the operator has seen the
    deletion until it is gone, whatever was queued (issue 48 counted 3-7: plan
    ConfigMap and status PATCHes, Events)."""
    ns = f"gated-mid-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    env = Env(api, ns, cluster)
    model_configmap(env.core, ns, "model", "gemma-3-1b-it.json")
    names = [f"mid-{i}" for i in range(3)]

    def mark_ready():
        for pod in env.core.list_namespaced_pod(ns).items:
            if not (pod.metadata.annotations or {}).get(READY):
                env.core.patch_namespaced_pod(pod.metadata.name, ns, {
                    "metadata": {"annotations": {READY: "true"}}})

    try:
        for name in names:
            env.create(infdep(name, replicas=2))
        wait_for(lambda: len(env.core.list_namespaced_pod(ns).items) == 6 or None, 60,
                 "six pods")
        mark_ready()
        for name in names:
            env.wait_condition(name, "Available", "True")
        for name in names:  # a new plan: new pods, left unready (still loading)
            env.patch(name, {"spec": {"offload": {"hostMemory": "12Gi"}}})
        for name in names:
            env.wait_condition(name, "Progressing", "True")  # RollingOut or InPlace
        start = len(operator.log_text())
        core.delete_namespace(ns)
        wait_for(lambda: not [n for n in core.list_namespace().items
                              if n.metadata.name == ns], 90, f"{ns} to go")
        time.sleep(3)
        text = operator.log_text()[start:]
        # A write sent before the namespaces' watch brought the news cannot be called
        # back (its answer may be logged after the news); from the news on, nothing is
        # sent, queued Events and the retries of the objects' reconciles included.
        seen = text.find(f"namespace {ns} is being deleted: no writes into it from now on")
        assert seen >= 0, text[-3000:]
        sent = re.findall(rf"sending (?:POST|PUT|PATCH|DELETE) \S*/namespaces/{ns}/\S*",
                          text[seen:])
        assert sent == [], "\n".join(sent[:20])
        print(f"writes answered after the DELETE: {writes_into(text, {ns})}")
    finally:
        if [n for n in core.list_namespace().items if n.metadata.name == ns]:
            core.delete_namespace(ns)
