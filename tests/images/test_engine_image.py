"""The CPU engine image (Dockerfile target ``engine-cpu``) as the operator's pod runs it.

The pod is the operator's own: render.deployment and render.plan_configmap for a tiny
model (Llama-3.2-1B's config cut to two layers, from tests/fixtures/models, with a
tokenizer trained here and no weights) on the emulated GPU, its weights on a read-only
volume. Its engine container becomes a ``docker run``: command, args, env, the plan
ConfigMap's files, the memory-backed /dev/shm, the weights volume, memory limit,
user, group, capabilities and privilege escalation as the pod spec says; a field the
translation does not know fails the test, so a change to the pod spec is seen here.
Probes and the preStop hook run inside the container, as the kubelet's would reach it.
"""

from __future__ import annotations

import json
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spillway_engine.emulator.tiny import shrink_config, write_model
from spillway_engine.planner.plan import Plan, make_plan
from spillway_engine.quantity import parse_bytes
from spillway_operator.flow import render
from spillway_operator.flow.spec import InferenceDeploymentSpec
from tests.images.conftest import FIGURES, ROOT, Images, wait_until
from tests.unit.tree.test_layers import MODULES

MODEL_FIXTURE = ROOT / "tests" / "fixtures" / "models" / "llama-3.2-1b.json"
WEIGHTS = "/models/tiny-llama"
SERVED = "tiny/llama"
START_S = 300  # about 20 s here; several engines may share two cores in CI
OWNER = render.Owner("tiny-llama", "images", "uid-images")
SPEC = {
    "model": {"name": SERVED},
    "weights": {"source": "pvc", "pvc": {"claimName": "tiny-llama", "path": WEIGHTS}},
    "engine": {"maxModelLen": 1024, "emulateGPU": {"speed": 0, "kvBytes": 8 << 20}},
    "offload": {"hostMemory": "16Mi"},
}
#: The chart's router container (charts/spillway/templates/router.yaml): read-only root,
#: no /tmp, user 1000, no capabilities.
ROUTER_SECURITY = ("--read-only", "--user", "1000:1000", "--cap-drop", "ALL",
                   "--security-opt", "no-new-privileges")
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def engine_pins() -> dict[str, str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["engine"]
    return dict(req.split("==") for req in extra)


def test_engine_image_has_the_pinned_vllm(images):
    """vLLM and torch at pyproject.toml's engine pins, importable by user 1000 on a
    read-only root filesystem."""
    code = ("import json, os, importlib.metadata as md, vllm, torch; print(json.dumps("
            "{'vllm': vllm.__version__, 'torch': md.version('torch'), 'uid': os.getuid()}))")
    done = images.run("run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
                      "--tmpfs", "/dev/shm", "--user", "1000:1000", "--entrypoint", "python",
                      images.engine, "-c", code, timeout=300)
    got = json.loads(done.stdout.splitlines()[-1])
    pins = engine_pins()
    assert got == {"vllm": pins["vllm"], "torch": pins["torch"], "uid": 1000}, got


def test_engine_image_imports_every_engine_module(images):
    """Every module of spillway_engine and spillway_cli imports in the image (vLLM there)."""
    modules = sorted(m for m in MODULES if m.split(".")[0] in ("spillway_engine", "spillway_cli")
                     and not m.endswith(".__main__"))
    assert len(modules) > 40, modules
    code = ("import importlib, json, sys\nbad = {}\nfor m in sys.argv[1:]:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except BaseException as e:\n        bad[m] = f'{type(e).__name__}: {e}'\n"
            "print(json.dumps(bad))")
    done = images.run("run", "--rm", "--network", "none", "--user", "1000:1000",
                      "--entrypoint", "python", images.engine, "-c", code, *modules, timeout=300)
    assert json.loads(done.stdout.splitlines()[-1]) == {}


def test_engine_image_is_pruned_and_keeps_what_the_engine_loads(images):
    """The CUDA kernels, compilers and libraries tools/images/engine-cpu-prune.txt lists
    are gone (recorded in the image), and every file the emulated engine was measured to
    load (tools/images/engine-cpu-loads.txt) is there."""
    loads = [line for line in (ROOT / "tools/images/engine-cpu-loads.txt").read_text()
             .splitlines() if line and not line.startswith("#")]
    code = ("import json, os, sys, sysconfig\n"
            "site = sysconfig.get_paths()['purelib']\n"
            "paths = sys.stdin.read().splitlines()  # a path may hold a space\n"
            "# files of distributions the image does not install (the probe's test harness)\n"
            "ours = [p for p in paths if os.path.exists(os.path.join(site, p.split('/')[0]))]\n"
            "missing = [p for p in ours if not os.path.exists(os.path.join(site, p))]\n"
            "pruned = open('/usr/local/share/spillway/engine-cpu-pruned.txt').read().splitlines()\n"
            "gone = [p for p in pruned if os.path.exists(os.path.join(site, p))]\n"
            "print(json.dumps({'missing': missing, 'checked': len(ours), 'pruned': len(pruned), "
            "'gone': gone}))")
    done = images.run("run", "--rm", "-i", "--network", "none", "--entrypoint", "python",
                      images.engine, "-c", code, input="\n".join(loads), timeout=300)
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["missing"] == [], got["missing"][:20]
    assert got["checked"] >= len(loads) - 10, got  # all but the harness's own few
    assert got["pruned"] >= 30 and got["gone"] == [], got
    size = images.inspect(images.engine)["Size"]
    FIGURES.append(f"engine-cpu image: {size / 1e9:.2f} GB ({got['pruned']} paths pruned)")
    assert size < 7e9, f"engine-cpu is {size / 1e9:.1f} GB: did the prune run?"


def test_prestop_command_answers(images):
    """The kubelet runs `spillway-engine drain` in the container as the preStop hook."""
    done = images.run("run", "--rm", "--network", "none", images.engine, "drain", "--help",
                      timeout=120)
    assert "usage: spillway-engine drain" in done.stdout and "--timeout" in done.stdout


# ------------------------------------------------------------------ the pod


@dataclass
class Pod:
    container: str
    engine: dict[str, Any]  # the pod spec's engine container
    pod_spec: dict[str, Any]
    plan: Plan
    model_dir: Path
    plan_dir: Path
    port: int

    def probe(self, images: Images, kind: str) -> int:
        """The status of the container's ``kind`` probe (startupProbe, readinessProbe, ...)."""
        get = self.engine[kind]["httpGet"]
        assert get["port"] == "http", get
        return images.http(self.container, get["path"], port=self.port, timeout=10)[0]


def _volume(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == name]
    return volume


def docker_run_args(pod_spec: dict[str, Any], files: dict[str, Path],
                    hostname: str) -> tuple[list[str], list[str]]:
    """``docker run`` flags for the pod's engine container, and the arguments after the
    image. ``files``: volume name -> the host folder that stands for it (the ConfigMap's
    files, the PVC's contents), and the termination message file."""
    (c,) = pod_spec["containers"]
    known = {"name", "image", "command", "args", "ports", "env", "resources", "volumeMounts",
             "terminationMessagePolicy", "startupProbe", "readinessProbe", "livenessProbe",
             "lifecycle", "securityContext"}
    assert set(c) <= known, f"engine container fields tests/images does not mirror: " \
        f"{sorted(set(c) - known)}"
    pod_security = pod_spec["securityContext"]
    assert set(pod_security) <= {"runAsNonRoot", "fsGroup", "seccompProfile"}, pod_security
    sc = c["securityContext"]
    assert set(sc) <= {"runAsNonRoot", "runAsUser", "runAsGroup", "allowPrivilegeEscalation",
                       "capabilities", "seccompProfile"}, sc
    assert sc["runAsNonRoot"] and pod_security["runAsNonRoot"] and sc["runAsUser"] != 0
    # the kubelet's RuntimeDefault seccomp profile is docker's default one
    assert sc["seccompProfile"] == pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    args = ["--network", "none", "--hostname", hostname, "--add-host", f"{hostname}:127.0.0.1",
            "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}",
            "--group-add", str(pod_security["fsGroup"])]
    if sc["allowPrivilegeEscalation"] is False:
        args += ["--security-opt", "no-new-privileges"]
    args += [a for cap in sc["capabilities"].get("drop", []) for a in ("--cap-drop", cap)]
    assert not sc["capabilities"].get("add"), sc
    resources = c["resources"]
    assert set(resources["limits"]) == {"memory"}, resources  # no GPU: emulated
    args += ["--memory", str(parse_bytes(resources["limits"]["memory"]))]
    cpu = resources["requests"]["cpu"]
    args += ["--cpu-shares", str(int(float(cpu.removesuffix("m")) * (1 if cpu.endswith("m")
                                                                         else 1000) * 1.024))]
    for env in c["env"]:
        if "value" in env:
            args += ["-e", f"{env['name']}={env['value']}"]
        else:
            assert env["valueFrom"] == {"fieldRef": {"apiVersion": "v1",
                                                     "fieldPath": "status.podIP"}}, env
            args += ["-e", f"{env['name']}=127.0.0.1"]  # the pod's IP: its loopback here
    for mount in c["volumeMounts"]:
        volume = _volume(pod_spec, mount["name"])
        ro = ",readonly" if mount.get("readOnly") else ""
        if "configMap" in volume or "persistentVolumeClaim" in volume:
            args += ["--mount", f"type=bind,source={files[mount['name']]},"
                                f"destination={mount['mountPath']}{ro}"]
        elif "emptyDir" in volume:  # medium Memory or not: a tmpfs, 0777 as the kubelet's
            size = volume["emptyDir"].get("sizeLimit")
            opts = [f"size={parse_bytes(size)}"] if size else []
            args += ["--tmpfs", f"{mount['mountPath']}:{','.join([*opts, 'mode=0777'])}"]
        else:
            raise AssertionError(f"volume kind tests/images does not mirror: {volume}")
    # the kubelet mounts a file for the termination message in every container
    args += ["--mount", f"type=bind,source={files['termination-log']},"
                        "destination=/dev/termination-log"]
    command = c["command"] + c.get("args", [])
    return [*args, "--entrypoint", command[0]], command[1:]


@pytest.fixture(scope="module")
def pod(images: Images, tmp_path_factory) -> Pod:
    root = tmp_path_factory.mktemp("engine-pod")
    root.chmod(0o755)
    config = shrink_config(json.loads(MODEL_FIXTURE.read_text())["config"], 2)
    model_dir = write_model(root / "model", config)
    spec = InferenceDeploymentSpec.model_validate(SPEC)
    plan = make_plan(json.loads((model_dir / "config.json").read_text()), spec.plan_request())
    deployment = render.deployment(OWNER, spec, plan)
    pod_spec = deployment["spec"]["template"]["spec"]
    plan_dir = root / "plan"
    plan_dir.mkdir()
    for key, text in render.plan_configmap(OWNER, spec, plan)["data"].items():
        (plan_dir / key).write_text(text)
    termination = root / "termination-log"
    termination.write_text("")
    termination.chmod(0o666)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644 if path != termination else 0o666)
    files = {"plan": plan_dir, "weights": model_dir, "termination-log": termination}
    flags, command = docker_run_args(pod_spec, files, f"{OWNER.name}-0")
    (engine,) = pod_spec["containers"]
    (port,) = [p["containerPort"] for p in engine["ports"] if p["name"] == "http"]
    start = time.monotonic()
    with images.container("engine", [*flags, images.engine, *command]) as name:
        p = Pod(name, engine, pod_spec, plan, model_dir, plan_dir, port)

        def started() -> bool:
            if not images.running(name):
                logs = images.run("logs", "--tail", "60", name, check=False)
                raise AssertionError(f"the engine container exited:\n{logs.stdout}{logs.stderr}")
            return p.probe(images, "startupProbe") == 200

        wait_until("the engine's startup probe", started, START_S)
        took = time.monotonic() - start
        FIGURES.append(f"engine-cpu pod ({SERVED}, emulated GPU): startup probe passed "
                       f"{took:.1f} s after docker run")
        print(FIGURES[-1])
        yield p


def test_engine_pod_serves_a_completion(images, pod):
    done = images.run("logs", pod.container)
    logs = done.stdout + done.stderr
    assert "Spillway plan check passed" in logs, logs[-3000:]
    assert re.search(r"version 0\.33\.0", logs), logs[-3000:]
    assert pod.probe(images, "readinessProbe") == 200
    assert pod.probe(images, "livenessProbe") == 200
    status, text = images.http(pod.container, "/v1/completions",
                               {"model": SERVED, "prompt": PROMPT, "max_tokens": 8})
    assert status == 200, text
    body = json.loads(text)
    assert body["model"] == SERVED and body["usage"]["completion_tokens"] == 8, body
    status, metrics = images.http(pod.container, "/metrics")
    assert status == 200 and "vllm:prompt_tokens_total" in metrics


def test_router_from_the_operator_image_routes_to_the_pod_by_prefix(images, pod):
    """spillway-router (operator image, as the chart runs it) beside the engine, in its
    network namespace: the engine's KV events over ZeroMQ and the model's own tokenizer
    (transformers) steer the second request of a prompt to the pod that holds it. Its
    endpoint picker (--epp-port, gRPC: grpcio and Envoy's protos from the image) answers
    the health check a gateway makes."""
    router_args = [
        "--network", f"container:{pod.container}", *ROUTER_SECURITY,
        "--mount", f"type=bind,source={pod.plan_dir},destination=/etc/spillway/plan,readonly",
        "--mount", f"type=bind,source={pod.model_dir},destination={WEIGHTS},readonly",
        "--entrypoint", "spillway-router", images.operator,
        "--port", "8080", "--tokenizer", f"{SERVED}={WEIGHTS}", "--epp-port", "9002",
        "--backend", f"model={SERVED},url=http://127.0.0.1:{pod.port},events=pod,"
                     "plan=/etc/spillway/plan/plan.json",
    ]
    with images.container("router", router_args) as router:
        def metric(name: str, label: str = "") -> float:
            status, text = images.http(router, "/metrics", port=8080, timeout=10)
            assert status == 200, text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{") and label in line)

        def ready() -> bool:
            assert images.running(router), images.run("logs", router, check=False).stderr
            return images.http(router, "/healthz", port=8080, timeout=10)[0] == 200

        wait_until("spillway-router /healthz", ready, 60)
        body = {"model": SERVED, "prompt": "router " + PROMPT, "max_tokens": 4}
        status, text = images.http(router, "/v1/completions", body, port=8080)
        assert status == 200, text
        wait_until("KV events from the engine",
                   lambda: metric("spillway_router_event_batches_total") >= 1, 30)
        status, text = images.http(router, "/v1/completions", body, port=8080)
        assert status == 200, text
        assert metric("spillway_router_requests_total", 'reason="prefix"') >= 1, \
            "the second request was not routed to the pod by its prefix"
        health = images.run("exec", router, "python", "-c", (
            "import grpc\n"
            "from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
            "stub = g.HealthStub(grpc.insecure_channel('127.0.0.1:9002'))\n"
            "for s in ('liveness', 'readiness', 'envoy.service.ext_proc.v3.ExternalProcessor'):\n"
            "    print(s, h.HealthCheckResponse.ServingStatus.Name("
            "stub.Check(h.HealthCheckRequest(service=s), timeout=10).status))\n"), timeout=60)
        assert health.stdout.split() == ["liveness", "SERVING", "readiness", "SERVING",
                                         "envoy.service.ext_proc.v3.ExternalProcessor",
                                         "SERVING"], health


def test_prestop_drain_then_sigterm_stops_the_pod(images, pod):
    """The kubelet's stop: the preStop hook (exec, as the container's user), readiness
    then fails while liveness holds, then SIGTERM; the engine exits 0 within the pod's
    grace period."""
    hook = pod.engine["lifecycle"]["preStop"]["exec"]["command"]
    grace = pod.pod_spec["terminationGracePeriodSeconds"]
    start = time.monotonic()
    done = images.run("exec", pod.container, *hook, timeout=grace, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pod.probe(images, "readinessProbe") == 503
    assert pod.probe(images, "livenessProbe") == 200
    images.run("stop", "-t", str(grace), pod.container, timeout=grace + 60)
    took = time.monotonic() - start
    state = json.loads(images.run("inspect", "-f", "{{json .State}}", pod.container).stdout)
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
    assert took < grace, f"stopped after {took:.0f} s, grace period {grace} s"
    FIGURES.append(f"engine-cpu pod: preStop drain + SIGTERM stopped it in {took:.1f} s "
                   f"(grace {grace} s)")
