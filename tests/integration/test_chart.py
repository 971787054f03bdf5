"""The Helm chart (charts/spillway) against the real control plane.

- `helm lint --strict`, and the strict values schema;
- the rendered manifests (cluster-wide and namespace-scoped) pass a server-side dry run;
- the chart's CRD is byte for byte crds/ (and renders with resource-policy keep);
- RBAC realism: the chart is installed, and the operator runs as the chart's
  ServiceAccount (a token from `kubectl create token`), namespaced and cluster-wide: an
  InferenceDeployment becomes Available and (namespaced) the autoscaler scales it through
  the scale subresource, with no 403 in the log, while everything the role does not need
  is denied (`kubectl auth can-i`). A ValidatingAdmissionPolicy fences off the session's
  admin-credentialed operator, so only the ServiceAccount can have done the writes;
- `helm uninstall` removes every operator object and keeps the CRD; `helm upgrade`
  upgrades a changed CRD (Helm would never upgrade one in the chart's crds/ folder).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from e2e.cluster.controlplane import REPO_ROOT, free_port, locate_binaries
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import fresh_namespace, wait_for

# Needs the local control plane harness itself (not an external cluster).
pytestmark = pytest.mark.local_only

MODELS = REPO_ROOT / "tests" / "fixtures" / "models"
CHART = REPO_ROOT / "charts" / "spillway"
CRD_FILE = REPO_ROOT / "crds" / "inferencedeployments.spillway.dev.yaml"
CRD_NAME = "inferencedeployments.spillway.dev"
RELEASE = "spillway"

# What the operator calls (operator/spillway_operator/plumbing/kube.py, handlers.py, and kopf's
# watches), as (apiGroup, resource, verb). The chart must grant exactly this.
NAMESPACED_RULES = {
    *{("spillway.dev", "inferencedeployments", v) for v in ("list", "watch")},
    ("spillway.dev", "inferencedeployments/status", "patch"),
    ("spillway.dev", "inferencedeployments/scale", "patch"),  # the autoscaler's write
    # create: a server-side apply that creates the object is authorized as patch AND create.
    *{("apps", "deployments", v) for v in ("get", "list", "watch", "patch", "create")},
    *{("", r, v) for r in ("services", "configmaps")
      for v in ("get", "list", "watch", "patch", "create")},
    # The engine pods' budget: watched, read and applied like the other children, never
    # deleted.
    *{("policy", "poddisruptionbudgets", v)
      for v in ("get", "list", "watch", "patch", "create")},
    *{("", "pods", v) for v in ("list", "watch")},
    ("", "pods", "patch"),  # the autoscaler's scale-down marks (deletion cost, draining)
    ("", "secrets", "get"),
    ("", "persistentvolumeclaims", "get"),  # a shared disk tier's claim, checked
    ("", "events", "create"),
    *{("monitoring.coreos.com", "servicemonitors", v) for v in ("get", "patch", "create")},
    # A replica across nodes: its LeaderWorkerSet, applied and watched (no delete: a
    # change of node count scales it to 0 by a patch).
    *{("leaderworkerset.x-k8s.io", "leaderworkersets", v)
      for v in ("get", "list", "watch", "patch", "create")},
}
CRD_READS = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
# Leader election (operator/spillway_operator/plumbing/leader.py): read, create and update the one
# Lease, in the release namespace only.
LEASE_RULES = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
NAMESPACE_READS = {("", "namespaces", v) for v in ("list", "watch")}
# An Ephemeral disk tier's storageClassName, checked (a cluster-scoped read).
STORAGE_CLASS_READS = {("storage.k8s.io", "storageclasses", "get")}
# A GPU pool's nodeSelector, listed by label (the MixedGPUProducts condition).
NODE_READS = {("", "nodes", "list")}
# rbac.clusterScopedReads: what the chart adds cluster-wide.
CLUSTER_READS = CRD_READS | NAMESPACE_READS | STORAGE_CLASS_READS | NODE_READS


def model_configmap(core: client.CoreV1Api, ns: str, name: str, fixture: str) -> None:
    from spillway_engine.planner.model_config import load_local

    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name),
        data={"config.json": json.dumps(load_local(MODELS / fixture))}))


def infdep(name: str, replicas: int = 1, autoscaling: dict | None = None) -> dict:
    spec = {"model": {"name": "google/gemma-3-1b-it", "configMapRef": {"name": "model"}},
            "replicas": replicas, "offload": {"hostMemory": "16Gi"}}
    if autoscaling:
        spec["autoscaling"] = {"enabled": True, **autoscaling}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
            "metadata": {"name": name}, "spec": spec}


def run(*args: str | Path, input: str | None = None, check: bool = True,
        env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, input=input,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def bins() -> dict[str, Path]:
    return locate_binaries()


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("helm-home")
    return {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}


@pytest.fixture
def helm(bins, helm_env, request):
    """helm; against the session's control plane when the test uses the `cluster` fixture
    (lint and template need no cluster, so those tests do not start one)."""
    kubeconfig = []
    if "cluster" in request.fixturenames:
        kubeconfig = [f"--kubeconfig={request.getfixturevalue('cluster').config.kubeconfig}"]

    installed: set[str] = set()  # namespaces this test installed the release into

    def helm(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
        if args and args[0] in ("install", "upgrade") and "-n" in args:
            installed.add(str(args[args.index("-n") + 1]))
        return run(bins["helm"], *kubeconfig, *args, check=check, env=helm_env)
    yield helm
    # A test that failed before its own uninstall must not leave cluster-scoped objects
    # (the release's ClusterRole and binding) for the next test to trip over.
    for ns in installed:
        run(bins["helm"], *kubeconfig, "uninstall", RELEASE, "-n", ns, "--ignore-not-found",
            "--wait", "--timeout", "60s", check=False, env=helm_env)


def render(helm, namespace: str, *sets: str, chart: Path = CHART) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    out = helm("template", RELEASE, chart, "-n", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rule_set(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def split_lease_role(docs: list[dict], kind: str) -> tuple[list[dict], dict | None]:
    """The objects of ``kind`` apart from the leader-election one, and that one."""
    objs = by_kind(docs, kind)
    lease = [d for d in objs if d["metadata"]["name"].endswith("-leader-election")]
    return [d for d in objs if d not in lease], (lease[0] if lease else None)


# ---------------------------------------------------------------- static checks


def test_helm_lint_strict(helm):
    for sets in ([], ["watchNamespaces={a,b}", "rbac.clusterScopedReads=false"],
                 ["serviceMonitor.enabled=true", "dashboard.enabled=true", "crds.install=false"]):
        args = [a for s in sets for a in ("--set", s)]
        out = helm("lint", "--strict", CHART, *args).stdout
        assert "0 chart(s) failed" in out, out


def test_values_schema_is_strict(helm):
    for bad, needle in (("operator.bogus=1", "bogus"), ("operator.replicas=9", "replicas"),
                        ("operator.podAntiAffinity=maybe", "podAntiAffinity"),
                        ("operator.leaderElection.leaseDuration=3", "leaseDuration"),
                        ("watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
                        ("crds.instal=true", "instal")):
        proc = helm("template", RELEASE, CHART, "--set", bad, check=False)
        assert proc.returncode != 0, bad
        assert needle in proc.stderr, proc.stderr
    # What a schema cannot say, the templates refuse with a reason.
    for sets, needle in ((["operator.replicas=2", "operator.leaderElection.enabled=false"],
                          "needs operator.leaderElection.enabled"),
                         (["operator.leaderElection.renewDeadlineSeconds=20"],
                          "leaseDurationSeconds must be greater than renewDeadlineSeconds"),
                         (["operator.leaderElection.retryPeriodSeconds=9"],
                          "greater than 1.2 x retryPeriodSeconds")):
        proc = helm("template", RELEASE, CHART, *[a for x in sets for a in ("--set", x)],
                    check=False)
        assert proc.returncode != 0 and needle in proc.stderr, (sets, proc.stderr)
    # One replica without election is still a valid chart.
    docs = render(helm, "ops", "operator.replicas=1", "operator.leaderElection.enabled=false")
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert split_lease_role(docs, "Role")[1] is None and not by_kind(docs, "PodDisruptionBudget")


def test_chart_crd_is_exactly_the_generated_crd(helm):
    copy = CHART / "files" / "crd.yaml"
    assert copy.read_bytes() == CRD_FILE.read_bytes(), (
        "charts/spillway/files/crd.yaml differs from crds/: run `make crd` (it refreshes both)")
    docs = render(helm, "spillway-system")
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    del crd["metadata"]["annotations"]
    assert crd == yaml.safe_load(CRD_FILE.read_text())
    assert not by_kind(render(helm, "spillway-system", "crds.install=false"),
                       "CustomResourceDefinition")
    # Helm never upgrades a chart's crds/ folder: the CRD must live in templates/ only.
    assert not (CHART / "crds").exists()


def test_rbac_rules_are_exactly_what_the_operator_calls(helm):
    # Cluster-wide (default): one ClusterRole, no Role but the Lease's.
    docs = render(helm, "spillway-system")
    (role,) = by_kind(docs, "ClusterRole")
    assert rule_set(role["rules"]) == NAMESPACED_RULES | CLUSTER_READS
    roles, lease_role = split_lease_role(docs, "Role")
    assert not roles
    assert lease_role["metadata"]["namespace"] == "spillway-system"
    assert rule_set(lease_role["rules"]) == LEASE_RULES
    _, lease_binding = split_lease_role(docs, "RoleBinding")
    assert lease_binding["roleRef"]["name"] == lease_role["metadata"]["name"]
    assert lease_binding["subjects"] == [{"kind": "ServiceAccount", "name": "spillway",
                                          "namespace": "spillway-system"}]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "spillway",
                                    "namespace": "spillway-system"}]
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "--all-namespaces" and "-n" not in args

    # Namespace-scoped: a Role per namespace; kopf's cluster reads in a small ClusterRole.
    docs = render(helm, "spillway-system", "watchNamespaces={a,b}")
    roles, lease_role = split_lease_role(docs, "Role")
    assert {r["metadata"]["namespace"] for r in roles} == {"a", "b"}
    assert all(rule_set(r["rules"]) == NAMESPACED_RULES for r in roles)
    assert lease_role["metadata"]["namespace"] == "spillway-system"
    assert rule_set(lease_role["rules"]) == LEASE_RULES
    bindings, _ = split_lease_role(docs, "RoleBinding")
    assert {b["metadata"]["namespace"] for b in bindings} == {"a", "b"}
    (reads,) = by_kind(docs, "ClusterRole")
    assert rule_set(reads["rules"]) == CLUSTER_READS
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["-n", "a", "-n", "b"] and "--all-namespaces" not in args

    docs = render(helm, "spillway-system", "watchNamespaces={a}", "rbac.clusterScopedReads=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


def test_operator_pod_is_restricted(helm):
    (dep,) = by_kind(render(helm, "spillway-system"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][1:] == ["--liveness", "http://0.0.0.0:8080/healthz", "--metrics-port",
                             "8081", "--log-format", "json", "--leader-elect",
                             "--leader-election-namespace", "spillway-system",
                             "--leader-election-id", "spillway-leader", "--lease-duration", "15",
                             "--renew-deadline", "10", "--retry-period", "2"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c[
        "env"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"healthz": 8080,
                                                                   "metrics": 8081}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_operator_is_highly_available(helm):
    docs = render(helm, "spillway-system")
    (dep,) = by_kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    selector = dep["spec"]["selector"]["matchLabels"]
    # Two replicas, one writer (the Lease); rolled one at a time, never below two.
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxUnavailable": 0, "maxSurge": 1}}
    # Spread over nodes (soft by default, so a one-node cluster still runs both).
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": selector}}
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    assert pdb["metadata"]["namespace"] == "spillway-system"

    (dep,) = by_kind(render(helm, "x", "operator.podAntiAffinity=hard"), "Deployment")
    (term,) = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    (dep,) = by_kind(render(helm, "x", "operator.podAntiAffinity=none"), "Deployment")
    assert "affinity" not in dep["spec"]["template"]["spec"]
    # Lease settings reach the command line; one replica renders no PDB (it would block
    # every drain).
    docs = render(helm, "x", "operator.replicas=1", "operator.leaderElection.leaseName=lead",
                  "operator.leaderElection.leaseDurationSeconds=30",
                  "operator.leaderElection.renewDeadlineSeconds=20",
                  "operator.leaderElection.retryPeriodSeconds=4")
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--leader-election-id") + 1] == "lead"
    assert [args[args.index(f) + 1] for f in ("--lease-duration", "--renew-deadline",
                                              "--retry-period")] == ["30", "20", "4"]
    assert not by_kind(docs, "PodDisruptionBudget")


def test_service_monitor_and_dashboard(helm):
    docs = render(helm, "mon", "serviceMonitor.enabled=true", "dashboard.enabled=true",
                  "dashboard.namespace=grafana")
    (sm,) = by_kind(docs, "ServiceMonitor")
    svc = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics"))
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    # spillway_offload_pressure's namespace label is the InferenceDeployment's.
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith(
        "-dashboard"))
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["spillway.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needle in ("spillway_offload_pressure", "spillway_host_pool_used_chunks",
                   "spillway_host_pool_capacity_chunks",
                   'vllm:prompt_tokens_cached_by_source_total{source="host"',
                   "kube_deployment_status_replicas"):
        assert needle in exprs
    default = render(helm, "mon")
    assert not by_kind(default, "ServiceMonitor")
    assert not [d for d in by_kind(default, "ConfigMap")]


# ---------------------------------------------------------------- against the apiserver


@pytest.mark.parametrize("scope", ["cluster-wide", "namespaced"])
def test_rendered_chart_passes_server_side_dry_run(helm, cluster, namespace, scope):
    sets = ["dashboard.enabled=true"]
    if scope == "namespaced":
        sets.append(f"watchNamespaces={{{namespace}}}")
    # The restricted Pod Security level is enforced for real by the API server's admission.
    # `warn` checks the Deployment's pod template at apply time (`enforce` only checks pods).
    cluster.kubectl("label", "namespace", namespace,
                    "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
    manifest = helm("template", RELEASE, CHART, "-n", namespace,
                    *[a for s in sets for a in ("--set", s)]).stdout
    proc = run(cluster.config.binaries["kubectl"], f"--kubeconfig={cluster.config.kubeconfig}",
               "apply", "--dry-run=server", "-f", "-", input=manifest)
    kinds = {line.split("/")[0].split(".")[0] for line in proc.stdout.splitlines()}
    want = {"customresourcedefinition", "serviceaccount", "deployment", "configmap",
            "poddisruptionbudget", "role", "rolebinding"}  # Role: the Lease's
    want |= {"clusterrole", "clusterrolebinding"}
    assert kinds == want, proc.stdout
    assert proc.stdout.count("(server dry run)") == len(proc.stdout.splitlines())
    # No PodSecurity warning ("would violate PodSecurity \"restricted:latest\"").
    assert "PodSecurity" not in proc.stderr and "violate" not in proc.stderr, proc.stderr
    # The check has teeth: the same Deployment without its container securityContext warns.
    (dep,) = by_kind([d for d in yaml.safe_load_all(manifest) if d], "Deployment")
    del dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    proc = run(cluster.config.binaries["kubectl"], f"--kubeconfig={cluster.config.kubeconfig}",
               "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(dep))
    assert 'would violate PodSecurity "restricted' in proc.stderr, proc.stderr


def _adopt_crd(cluster, namespace: str) -> None:
    """Let the release take over a CRD applied earlier by `kubectl apply -f crds/`
    (the session fixture `crd_installed`, or a previous release): Helm adopts an existing
    object only when it carries the release's ownership metadata (see NOTES.txt)."""
    if not cluster.kubectl("get", "crd", CRD_NAME, "--ignore-not-found", "-o", "name"):
        return
    cluster.kubectl("label", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cluster.kubectl("annotate", "crd", CRD_NAME, "--overwrite",
                    f"meta.helm.sh/release-name={RELEASE}",
                    f"meta.helm.sh/release-namespace={namespace}")


def _release_objects(cluster, namespaces: list[str]) -> list[str]:
    sel = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/part-of=spillway"
    found = cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", sel, "-o", "name")
    for ns in namespaces:
        found += cluster.kubectl("get", "deployments,serviceaccounts,roles,rolebindings,"
                                 "services,configmaps", "-n", ns, "-l", sel, "-o", "name")
    return found.split()


@pytest.fixture
def work_namespace(cluster, api) -> Iterator[str]:
    """The namespace the namespaced operator watches (the release lives in another one)."""
    with fresh_namespace(api, f"chart-work-{uuid.uuid4().hex[:5]}") as name:
        yield name


@pytest.fixture
def fence(cluster, work_namespace) -> Iterator:
    """Only the chart's ServiceAccount may reconcile in the work namespace.

    The session's cluster-wide operator (fixture `operator`, admin credentials, which
    bypass RBAC) may be running from an earlier test module and would reconcile this
    test's object too, so children it created would prove nothing. A
    ValidatingAdmissionPolicy (admission applies even to system:masters) denies the
    admin user the operator's writes in the work namespace: creating or updating
    children, writing the InferenceDeployment, its status or scale, and Events.
    Call it after the test's own admin writes of inputs (the model ConfigMap)."""
    name = f"chart-fence-{work_namespace}"
    admin = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    assert admin, "no username from kubectl auth whoami"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [
                # Every kind of child: a gap lets the admin operator create that one
                # (the PDBs were missing: it found the others in its cache, then POSTed
                # the PDB before the chart's operator did, and CI failed now and then).
                {"apiGroups": ["", "apps", "policy", "monitoring.coreos.com"],
                 "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                 "resources": ["configmaps", "services", "deployments",
                               "poddisruptionbudgets", "servicemonitors", "events"]},
                {"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
                 "resources": [PLURAL, f"{PLURAL}/status", f"{PLURAL}/scale"]},
            ]},
            "validations": [{
                "expression": f"request.userInfo.username != {json.dumps(admin)}",
                "message": "test isolation: only the chart's ServiceAccount reconciles here",
            }],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": work_namespace}}}},
    }

    def up() -> None:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([policy, binding]))

        def denied(*create: str) -> bool:
            out = subprocess.run(
                [str(cluster.config.binaries["kubectl"]),
                 f"--kubeconfig={cluster.config.kubeconfig}", "create", *create,
                 "-n", work_namespace, "--dry-run=server"],
                capture_output=True, text=True, timeout=30)
            return out.returncode != 0 and "test isolation" in out.stderr
        wait_for(lambda: denied("configmap", "probe"), 30,
                 "the admission policy to deny the admin user")
        # ... every kind of child, the policy group's PDB included.
        assert denied("poddisruptionbudget", "probe", "--selector=a=b", "--min-available=1")

    yield up
    cluster.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy",
                    name, "--ignore-not-found")


def _sa_kubeconfig(cluster, namespace: str, sa: str, path: Path) -> Path:
    admin = yaml.safe_load(cluster.config.kubeconfig.read_text())
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").strip()
    user = f"system:serviceaccount:{namespace}:{sa}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"],
                                                 "user": user}}],
        "current-context": "sa",
    }))
    path.chmod(0o600)
    return path


def _can_i(cluster, sa_user: str, *args: str) -> bool:
    out = cluster.kubectl("auth", "can-i", f"--as={sa_user}", *args, check=False).strip()
    return out == "yes"


@pytest.mark.parametrize("scope", ["namespaced", "cluster-wide"])
def test_operator_runs_as_the_chart_service_account(helm, cluster, api, namespace, work_namespace,
                                                    fence, tmp_path, scope):
    release_ns, work = namespace, work_namespace
    namespaced = scope == "namespaced"
    cluster.kubectl("label", "namespace", release_ns,
                    "pod-security.kubernetes.io/enforce=restricted")
    _adopt_crd(cluster, release_ns)
    # The operator pod "runs" on a KWOK node (any image), so --wait sees it Available, and
    # the restricted Pod Security level admitted it.
    sets = ["--set", f"watchNamespaces={{{work}}}"] if namespaced else []
    helm("install", RELEASE, CHART, "-n", release_ns, *sets, "--wait", "--timeout", "90s")
    cluster.wait_established(CRD_NAME)
    crd = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json"))
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    # The live role is the rendered one.
    if namespaced:
        role = json.loads(cluster.kubectl("get", "role", RELEASE, "-n", work, "-o", "json"))
        assert rule_set(role["rules"]) == NAMESPACED_RULES
    else:
        role = json.loads(cluster.kubectl("get", "clusterrole", f"{RELEASE}-{release_ns}", "-o",
                                          "json"))
        assert rule_set(role["rules"]) == NAMESPACED_RULES | CLUSTER_READS

    sa_user = f"system:serviceaccount:{release_ns}:{RELEASE}"
    # Granted: what the operator does.
    granted = [["patch", "deployments.apps", "-n", work],
               ["create", "deployments.apps", "-n", work],
               ["patch", "inferencedeployments.spillway.dev", "-n", work, "--subresource",
                "status"],
               ["patch", "inferencedeployments.spillway.dev", "-n", work, "--subresource",
                "scale"],
               ["create", "events", "-n", work], ["get", "secrets", "-n", work],
               ["patch", "pods", "-n", work],
               ["patch", "poddisruptionbudgets.policy", "-n", work],
               *[[v, "leaderworkersets.leaderworkerset.x-k8s.io", "-n", work]
                 for v in ("get", "list", "watch", "patch", "create")],
               ["watch", "customresourcedefinitions.apiextensions.k8s.io"],
               ["list", "namespaces"], ["watch", "namespaces"],
               ["get", "persistentvolumeclaims", "-n", work],
               ["get", "storageclasses.storage.k8s.io"], ["list", "nodes"],
               *[[v, "leases.coordination.k8s.io", "-n", release_ns]
                 for v in ("get", "create", "update")]]
    # Denied: everything else, including what a looser role would hand out.
    denied = [["delete", "deployments.apps", "-n", work],
              ["delete", "poddisruptionbudgets.policy", "-n", work],
              ["deletecollection", "poddisruptionbudgets.policy", "-n", work],
              ["update", "deployments.apps", "-n", work],
              *[[v, "leaderworkersets.leaderworkerset.x-k8s.io", "-n", work]
                for v in ("delete", "update")],
              ["create", "pods", "-n", work], ["delete", "pods", "-n", work],
              ["get", "pods", "-n", work], ["update", "pods", "-n", work],
              ["patch", "pods", "-n", work, "--subresource", "status"],
              ["create", "pods", "-n", work, "--subresource", "eviction"],
              ["create", "pods", "-n", work, "--subresource", "exec"],
              ["get", "pods", "-n", work, "--subresource", "log"],
              ["list", "secrets", "-n", work], ["watch", "secrets", "-n", work],
              ["create", "secrets", "-n", work],
              ["get", "inferencedeployments.spillway.dev", "-n", work],
              ["patch", "inferencedeployments.spillway.dev", "-n", work],
              ["delete", "inferencedeployments.spillway.dev", "-n", work],
              ["update", "inferencedeployments.spillway.dev", "-n", work, "--subresource",
               "scale"],
              ["get", "inferencedeployments.spillway.dev", "-n", work, "--subresource",
               "scale"],
              ["create", "customresourcedefinitions.apiextensions.k8s.io"],
              ["get", "nodes"], ["watch", "nodes"], ["patch", "nodes"],
              ["create", "clusterrolebindings.rbac.authorization.k8s.io"],
              ["delete", "namespaces"], ["create", "namespaces"],
              ["list", "persistentvolumeclaims", "-n", work],
              ["create", "persistentvolumeclaims", "-n", work],
              ["list", "storageclasses.storage.k8s.io"],
              ["create", "storageclasses.storage.k8s.io"],
              *[[v, "leases.coordination.k8s.io", "-n", release_ns]
                for v in ("list", "watch", "patch", "delete")],
              ["update", "leases.coordination.k8s.io", "-n", work],
              ["get", "leases.coordination.k8s.io", "-n", "kube-system"]]
    if namespaced:
        denied += [["get", "secrets", "-n", release_ns], ["get", "secrets", "-n", "default"],
                   ["patch", "deployments.apps", "-n", "default"],
                   ["list", "inferencedeployments.spillway.dev", "-n", "default"],
                   ["get", "secrets", "-A"]]
    else:
        granted += [["get", "secrets", "-n", "default"], ["patch", "deployments.apps", "-A"]]
    for args in granted:
        assert _can_i(cluster, sa_user, *args), args
    for args in denied:
        assert not _can_i(cluster, sa_user, *args), args

    # The operator, as a process, with nothing but the ServiceAccount's token.
    kubeconfig = _sa_kubeconfig(cluster, release_ns, RELEASE, tmp_path / "sa.kubeconfig")
    port = free_port()
    log = tmp_path / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "SPILLWAY_RESYNC_SECONDS": "20",
           "SPILLWAY_WATCH_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway_operator",
             *(["-n", work] if namespaced else ["--all-namespaces"]),
             "--liveness", "", "--metrics-port", str(port), "--verbose",
             # As the chart runs it: standing for election on the release's Lease.
             "--leader-elect", "--leader-election-namespace", release_ns,
             "--leader-election-id", "spillway-leader"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    text = lambda: log.read_text(errors="replace")  # noqa: E731
    try:
        wait_for(lambda: proc.poll() is not None or "spillway operator started" in text(), 60,
                 "the operator to start")
        assert proc.poll() is None, text()[-3000:]
        wait_for(lambda: "became the leader" in text(), 30, "the operator to take the Lease")
        lease = json.loads(cluster.kubectl("get", "lease", "spillway-leader", "-n", release_ns,
                                           "-o", "json"))
        assert lease["spec"]["holderIdentity"] in text()

        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom = client.CustomObjectsApi(api)
        model_configmap(core, work, "model", "gemma-3-1b-it.json")
        model_configmap(core, work, "llama", "llama-3.2-1b.json")  # the multi-node replica's
        fence()  # from here on, only the chart's ServiceAccount can write the results
        # Namespaced: with the autoscaler on, so its writes (scale subresource, status) run
        # with the ServiceAccount too; two replicas that idle simulators let it scale down.
        body = (infdep("gemma", 2, {"minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 2,
                                    "scaleDownStabilizationSeconds": 0})
                if namespaced else infdep("gemma"))
        custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, body)

        def available():
            assert " 403 " not in text(), text()[-4000:]  # fail fast on a missing rule
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, work, PLURAL, "gemma")
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            c = conds.get("Available")
            return obj if c and c["status"] == "True" else None

        obj = wait_for(available, 90, f"gemma Available=True (operator log: {log})")
        assert obj["status"]["readyReplicas"] >= 1
        assert apps.read_namespaced_deployment("gemma", work).spec.replicas == body["spec"][
            "replicas"]
        assert core.read_namespaced_service("gemma", work).spec.ports[0].port == 8000
        assert "plan.json" in core.read_namespaced_config_map("gemma-plan", work).data
        # Nothing of kopf's on the object: no finalizer, no progress annotations.
        assert not obj["metadata"].get("finalizers")
        assert not [a for a in obj["metadata"].get("annotations") or {} if "kopf" in a]
        wait_for(lambda: "PlanComputed" in {e.reason for e in core.list_namespaced_event(
            work, field_selector="involvedObject.name=gemma").items}, 30, "the operator's Events")

        if namespaced:
            # Engine simulators on the pods' loopback IPs, idle: the autoscaler scrapes
            # them and scales down to 1 through the scale subresource.
            from e2e.simfleet import SimulatorFleet

            with SimulatorFleet(api, work, "gemma", ["--max-num-seqs", "4", "--speed", "1"]):
                wait_for(lambda: custom.get_namespaced_custom_object(
                    GROUP, VERSION, work, PLURAL, "gemma")["spec"]["replicas"] == 1, 60,
                    "the autoscaler's scale-down to 1 replica")
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, work, PLURAL, "gemma")
            assert "pressure" in obj["status"]["autoscaling"]

        # This operator (not another one) created the children.
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget"):
            assert (f'spillway_operator_child_writes_total{{action="created",kind="{kind}"}} 1.0'
                    in metrics), metrics

        if not namespaced:
            # A replica of 16 GPUs on 8-GPU nodes: a LeaderWorkerSet group, made and read
            # with the ServiceAccount's token (two free nodes: gemma's one GPU is on a third).
            big = infdep("big")
            big["spec"]["model"] = {"name": "meta-llama/Llama-3.2-1B",
                                    "configMapRef": {"name": "llama"}}
            big["spec"]["engine"] = {"tensorParallelSize": 16}
            custom.create_namespaced_custom_object(GROUP, VERSION, work, PLURAL, big)
            obj = wait_for(lambda: (o := custom.get_namespaced_custom_object(
                GROUP, VERSION, work, PLURAL, "big")).get("status", {}).get(
                    "readyReplicas") == 1 and o, 90, f"big's group Ready (operator log: {log})")
            lws = custom.get_namespaced_custom_object("leaderworkerset.x-k8s.io", "v1", work,
                                                      "leaderworkersets", "big")
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            custom.delete_namespaced_custom_object(GROUP, VERSION, work, PLURAL, "big")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    logtext = text()
    for needle in (" 403 ", "Forbidden", "forbidden", "Not enough permissions"):
        assert needle not in logtext, f"{needle!r} in the operator log:\n{logtext[-4000:]}"
    # kopf and the operator's own watches started exactly the watches the role is for.
    for watched in ("customresourcedefinitions.v1.apiextensions.k8s.io cluster-wide",
                    "inferencedeployments.v1alpha1.spillway.dev", "configmaps.v1"):
        assert f"Starting the watch-stream for {watched}" in logtext, watched
    scope = work if namespaced else "all namespaces"
    for plural in ("deployments", "services", "poddisruptionbudgets", "pods"):
        assert re.search(rf"watch {plural} in {scope}: listed \d+, watching", logtext), plural
    assert re.search(r"watch namespaces in all namespaces: listed \d+, watching", logtext)
    assert ("Starting the watch-stream for namespaces.v1" in logtext) == namespaced
    if namespaced:  # the autoscaler's write went through this ServiceAccount
        assert re.search(rf'"PATCH /apis/{GROUP}/{VERSION}/namespaces/{work}/{PLURAL}/gemma/scale'
                         r' HTTP/1\.1" 200', logtext), logtext[-4000:]
        # ... and so did its mark on the pod that went (before the scale write).
        assert re.search(rf'"PATCH /api/v1/namespaces/{work}/pods/gemma-[a-z0-9-]+'
                         r' HTTP/1\.1" 200', logtext), logtext[-4000:]

    # Uninstall: no operator object is left; the CRD (and so users' objects) stays.
    helm("uninstall", RELEASE, "-n", release_ns, "--wait", "--timeout", "60s")
    assert _release_objects(cluster, [release_ns, work]) == []
    assert not cluster.kubectl("get", "role,rolebinding", "-n", work, "-o", "name")
    assert cluster.kubectl("get", "crd", CRD_NAME, "-o", "name").strip()
    assert custom.get_namespaced_custom_object(GROUP, VERSION, work, PLURAL, "gemma")
    custom.delete_namespaced_custom_object(GROUP, VERSION, work, PLURAL, "gemma")


def test_helm_upgrade_upgrades_the_crd_and_uninstall_keeps_it(helm, cluster, namespace,
                                                              tmp_path):
    # A copy of the chart whose CRD has one more printer column.
    changed = tmp_path / "spillway"
    subprocess.run(["cp", "-r", str(CHART), str(changed)], check=True)
    crd = yaml.safe_load(CRD_FILE.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Chart-Test", "type": "string", "jsonPath": ".metadata.uid", "priority": 1})
    (changed / "files" / "crd.yaml").write_text(yaml.safe_dump(crd, sort_keys=False))

    def columns() -> list[str]:
        live = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json"))
        return [c["name"] for c in live["spec"]["versions"][0]["additionalPrinterColumns"]]

    _adopt_crd(cluster, namespace)
    # Cluster-wide variant, operator scaled to 0: this test is about the release's objects.
    helm("install", RELEASE, CHART, "-n", namespace, "--set", "operator.replicas=0", "--wait",
         "--timeout", "60s")
    try:
        assert "Chart-Test" not in columns()
        cr = json.loads(cluster.kubectl("get", "clusterrole", f"{RELEASE}-{namespace}", "-o",
                                        "json"))
        assert rule_set(cr["rules"]) == NAMESPACED_RULES | CLUSTER_READS

        helm("upgrade", RELEASE, changed, "-n", namespace, "--set", "operator.replicas=0",
             "--wait", "--timeout", "60s")
        assert "Chart-Test" in columns()
        # And back: a downgrade of the chart takes the column away again.
        helm("upgrade", RELEASE, CHART, "-n", namespace, "--set", "operator.replicas=0",
             "--wait", "--timeout", "60s")
        assert "Chart-Test" not in columns()
    finally:
        helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s", check=False)
    assert _release_objects(cluster, [namespace]) == []
    assert cluster.kubectl("get", "crd", CRD_NAME, "-o", "name").strip()
    # The kept CRD is the generated one again (the session's `kubectl apply -f crds/` agrees).
    want = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]
    assert columns() == [c["name"] for c in want["additionalPrinterColumns"]]


def test_router_is_opt_in_least_privilege_and_admitted(helm, cluster, namespace):
    """spillway-router renders only when asked, reads pods and plan ConfigMaps and
    nothing else, and its objects pass the API server's admission (restricted PSA)."""
    assert not [d for d in render(helm, namespace)
                if d["metadata"]["name"].endswith("-router")]
    docs = [d for d in render(helm, namespace, "router.enabled=true")
            if d["metadata"]["name"].endswith("-router")]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    (role,) = by_kind(docs, "Role")
    assert rule_set(role["rules"]) == {("", "pods", "list"), ("", "pods", "watch"),
                                       ("", "configmaps", "get")}
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    cluster.kubectl("label", "namespace", namespace,
                    "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
    proc = run(cluster.config.binaries["kubectl"], f"--kubeconfig={cluster.config.kubeconfig}",
               "apply", "--dry-run=server", "-n", namespace, "-f", "-",
               input=yaml.safe_dump_all(docs))
    assert proc.stdout.count("(server dry run)") == len(docs), proc.stdout
    assert "PodSecurity" not in proc.stderr and "violate" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the endpoint picker

# router.endpointPicker: the InferencePools, in a Role of the release namespace only.
POOL_RULES = {("inference.networking.k8s.io", "inferencepools", v)
              for v in ("get", "create", "patch")}
EPP = ["router.enabled=true", "router.endpointPicker.enabled=true"]
POOLS_RESOURCE = "inferencepools.inference.networking.k8s.io"


def test_endpoint_picker_is_opt_in_and_wires_router_operator_and_rbac(helm):
    def operator_args(docs: list[dict]) -> list[str]:
        (dep,) = [d for d in by_kind(docs, "Deployment")
                  if not d["metadata"]["name"].endswith("-router")]
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    def pool_roles(docs: list[dict], kind: str) -> list[dict]:
        return [d for d in by_kind(docs, kind)
                if d["metadata"]["name"].endswith("-inference-pools")]

    for sets in ([], ["router.enabled=true"]):  # off by default, the router's too
        docs = render(helm, "sys", *sets)
        assert "--endpoint-picker" not in operator_args(docs)
        assert not pool_roles(docs, "Role") and "grpc-epp" not in json.dumps(docs)
        assert all("--epp-port" not in c["args"] for d in by_kind(docs, "Deployment")
                   for c in d["spec"]["template"]["spec"]["containers"])

    docs = render(helm, "sys", *EPP, "router.endpointPicker.port=9100")
    router = {d["kind"]: d for d in docs if d["metadata"]["name"] == "spillway-router"}
    (c,) = router["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--epp-port") + 1] == "9100"
    assert {"name": "grpc-epp", "containerPort": 9100} in c["ports"]
    assert {"name": "grpc-epp", "port": 9100, "targetPort": "grpc-epp"} in router["Service"][
        "spec"]["ports"]
    # The operator names the router's Service and its picker port, in the release namespace.
    args = operator_args(docs)
    assert args[args.index("--endpoint-picker") + 1] == "sys/spillway-router:9100"
    from spillway_operator.flow.routing import parse_endpoint_picker

    picker = parse_endpoint_picker(args[args.index("--endpoint-picker") + 1])
    assert (picker.namespace, picker.service, picker.port) == (
        "sys", router["Service"]["metadata"]["name"], 9100)
    # RBAC: the pools in the release namespace alone, bound to the operator's account; the
    # operator's other roles are unchanged.
    (role,) = pool_roles(docs, "Role")
    assert role["metadata"]["namespace"] == "sys" and rule_set(role["rules"]) == POOL_RULES
    (binding,) = pool_roles(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "spillway",
                                    "namespace": "sys"}]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert rule_set(cluster_role["rules"]) == NAMESPACED_RULES | CLUSTER_READS
    docs = render(helm, "sys", *EPP, "watchNamespaces={a,sys}")
    operator_roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == RELEASE]
    assert {r["metadata"]["namespace"] for r in operator_roles} == {"a", "sys"}
    assert all(rule_set(r["rules"]) == NAMESPACED_RULES for r in operator_roles)
    assert [r["metadata"]["namespace"] for r in pool_roles(docs, "Role")] == ["sys"]
    out = helm("lint", "--strict", CHART, *[a for s in EPP for a in ("--set", s)]).stdout
    assert "0 chart(s) failed" in out, out

    # What cannot work is refused, with the reason.
    for sets, needle in ((["router.endpointPicker.enabled=true"], "needs router.enabled"),
                         ([*EPP, "router.namespace=elsewhere"], "release namespace"),
                         ([*EPP, "watchNamespaces={a}"], "watchNamespaces must include"),
                         ([*EPP, "router.endpointPicker.port=70000"], "endpointPicker/port"),
                         ([*EPP, "router.endpointPicker.prot=1"], "prot")):
        proc = helm("template", RELEASE, CHART, "-n", "sys",
                    *[a for s in sets for a in ("--set", s)], check=False)
        assert proc.returncode != 0 and needle in proc.stderr, (sets, proc.stderr)


def test_operator_makes_inference_pools_as_the_chart_service_account(
        helm, cluster, api, crd_installed, work_namespace, fence, tmp_path):
    """The chart with the endpoint picker, installed into the namespace it serves; GIE's
    real InferencePool CRD served; the operator run with the chart's ServiceAccount token
    and the chart's --endpoint-picker: the InferenceDeployment's pool is made through the
    new Role (the fence keeps the session's admin operator from writing here), nothing is
    forbidden, and the Role grants nothing more."""
    from e2e.cluster.controlplane import GIE_INFERENCE_POOL_CRD, locate_gie_crds

    ns = work_namespace
    pool_crd = "inferencepools.inference.networking.k8s.io"
    installed_here = not cluster.kubectl("get", "crd", pool_crd, "--ignore-not-found",
                                         "-o", "name").strip()
    if installed_here:
        cluster.kubectl("apply", "--server-side", "-f",
                        locate_gie_crds() / GIE_INFERENCE_POOL_CRD)
        cluster.wait_established(pool_crd)
    proc = None
    log = tmp_path / "operator.log"
    log.touch()
    text = lambda: log.read_text(errors="replace")  # noqa: E731
    try:
        helm("install", RELEASE, CHART, "-n", ns, "--set", "crds.install=false",
             "--set", "operator.replicas=0", *[a for s in EPP for a in ("--set", s)])
        live = json.loads(cluster.kubectl("get", "deployment", RELEASE, "-n", ns, "-o", "json"))
        args = live["spec"]["template"]["spec"]["containers"][0]["args"]
        picker = args[args.index("--endpoint-picker") + 1]
        assert picker == f"{ns}/{RELEASE}-router:9002"

        sa_user = f"system:serviceaccount:{ns}:{RELEASE}"
        for verb in ("get", "create", "patch"):
            assert _can_i(cluster, sa_user, verb, POOLS_RESOURCE, "-n", ns), verb
        for verb in ("list", "watch", "update", "delete", "deletecollection"):
            assert not _can_i(cluster, sa_user, verb, POOLS_RESOURCE, "-n", ns), verb
        assert not _can_i(cluster, sa_user, "create", POOLS_RESOURCE, "-n", "default")

        kubeconfig = _sa_kubeconfig(cluster, ns, RELEASE, tmp_path / "sa.kubeconfig")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "SPILLWAY_RESYNC_SECONDS": "20",
               "SPILLWAY_WATCH_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spillway_operator", "-n", ns, "--liveness", "",
                 "--metrics-port", str(free_port()), "--verbose", "--endpoint-picker", picker],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        wait_for(lambda: proc.poll() is not None or "spillway operator started" in text(), 60,
                 "the operator to start")
        assert proc.poll() is None, text()[-3000:]

        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        model_configmap(core, ns, "model", "gemma-3-1b-it.json")
        fence()  # from here on, only the chart's ServiceAccount can write the results
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, infdep("gemma"))

        def pooled():
            assert " 403 " not in text(), text()[-4000:]  # fail fast on a missing rule
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gemma")
            return obj if (obj.get("status") or {}).get("routing") == "InferencePool" else None

        wait_for(pooled, 90, f"gemma's InferencePool (operator log: {log})")
        pool = custom.get_namespaced_custom_object("inference.networking.k8s.io", "v1", ns,
                                                   "inferencepools", "gemma")
        assert pool["spec"]["endpointPickerRef"]["name"] == f"{RELEASE}-router"
        assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}
        # The picker's Service exists where the pool names it, with that port.
        svc = core.read_namespaced_service(f"{RELEASE}-router", ns)
        assert {(p.name, p.port) for p in svc.spec.ports} >= {("grpc-epp", 9002)}
        assert re.search(rf'"(POST|PATCH) /apis/inference\.networking\.k8s\.io/v1/namespaces/'
                         rf'{ns}/inferencepools[/?][^"]*HTTP/1\.1" 20[01]', text())
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", check=False)
        if installed_here:
            cluster.kubectl("delete", "crd", pool_crd, "--ignore-not-found")
    logtext = text()
    for needle in (" 403 ", "Forbidden", "forbidden", "Traceback"):
        assert needle not in logtext, f"{needle!r} in the operator log:\n{logtext[-4000:]}"

