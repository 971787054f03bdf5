"""Hostile users and broken pods against the real control plane and the operator
process: every bad input ends in an admission refusal naming the field or in a
condition and an Event, never in a retry loop, a traceback or a blind autoscaler."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client

from e2e.cluster.controlplane import locate_binaries
from spillway_engine.seam import PROTECTED_FLAGS, PROTECTED_SHORT_FLAGS, refused_flag
from spillway_engine.vllm_cli import bad_int_value, unknown_long_flag
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for
from tests.integration.test_operator import Env, infdep, model_configmap

pytestmark = pytest.mark.usefixtures("operator")


@pytest.fixture
def env(api, namespace, cluster):
    e = Env(api, namespace, cluster)
    model_configmap(e.core, namespace, "model", "gemma-3-1b-it.json")
    return e


def kubectl_apply(env, body, tmp_path) -> subprocess.CompletedProcess:
    manifest = tmp_path / "obj.yaml"
    manifest.write_text(yaml.safe_dump(body))
    return subprocess.run(
        [str(locate_binaries()["kubectl"]), f"--kubeconfig={env.cluster.config.kubeconfig}",
         "apply", "-n", env.ns, "-f", str(manifest)],
        capture_output=True, text=True, timeout=30,
    )


def log_since(operator, offset: int) -> str:
    return operator.log_text()[offset:]


def lines_about(text: str, ns: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if f"{ns}/{name}" in ln or f"[{ns}/{name}]" in ln]


# ------------------------------------------------------------------ 1: refused children


@pytest.mark.local_only  # reads the operator's log
@pytest.mark.parametrize(("engine", "resources", "needle"), [
    # Server-side apply answers 500 (duplicate list key): a retry cannot fix it.
    ({"env": [{"name": "FOO", "value": "a"}, {"name": "FOO", "value": "b"}]}, {},
     "duplicate entries"),
    # Deployment validation answers 422.
    ({}, {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}, "toleration"),
])
def test_a_child_the_api_server_refuses_is_a_condition_and_an_event(env, operator, engine,
                                                                     resources, needle):
    start = len(operator.log_text())
    body = infdep("refused", resources=resources) if resources else infdep("refused")
    body["spec"]["engine"].update(engine)
    env.create(body)
    c = env.wait_condition("refused", "Available", "False", "ApplyRejected", timeout=30)
    assert needle in c["message"].lower() or needle in c["message"]
    assert env.condition("refused", "Degraded")["status"] == "True"
    assert env.condition("refused", "PlanReady")["status"] == "True"
    wait_for(lambda: any(e.reason == "ApplyRejected" and e.type == "Warning"
                         for e in env.events("refused")), 30, "the ApplyRejected Event")
    assert env.deployment("refused") is None
    # No retry loop: over the next seconds the operator says it once and goes quiet.
    time.sleep(8)
    text = log_since(operator, start)
    assert "Traceback" not in text
    # The children created, and one line per condition that turned bad: no line twice.
    about = lines_about(text, env.ns, "refused")
    assert len(about) == len(set(about)) and len(about) <= 5, about
    assert sum("ApplyRejected" in ln for ln in about) <= 2, about


# ------------------------------------------------------------------ 2: plan-owned input


@pytest.mark.parametrize(("engine", "needle"), [
    ({"extraArgs": ["--tensor-parallel-size", "8"]}, "--tensor-parallel-size"),
    ({"extraArgs": ["-tp=8"]}, "-tp=8"),
    ({"extraArgs": ["--Max_Model_Len=4096"]}, "--Max_Model_Len"),
    ({"extraArgs": ["--no-enable-prefix-caching"]}, "--no-enable-prefix-caching"),
    ({"extraArgs": ["--kv-transfer-config.kv_connector=X"]}, "--kv-transfer-config"),
    ({"env": [{"name": "SPILLWAY_PLAN", "value": "/tmp/x"}]}, "SPILLWAY_PLAN"),
    ({"env": [{"name": "PYTHONPATH", "value": "/evil"}]}, "PYTHONPATH"),
    ({"env": [{"name": "VLLM_PLUGINS", "value": ""}]}, "VLLM_PLUGINS"),
    # what vLLM reads that the plan assumed: refused naming the field the plan follows
    ({"env": [{"name": "VLLM_PP_LAYER_PARTITION", "value": "10,6"}]},
     "the plan follows from spec.engine.pipelineParallelSize"),
    ({"env": [{"name": "VLLM_DP_SIZE", "value": "2"}]},
     "the plan follows from spec.engine.dataParallelSize"),
])
def test_plan_owned_flags_and_env_are_refused_at_admission(env, tmp_path, engine, needle):
    body = infdep("owned")
    body["spec"]["engine"].update(engine)
    proc = kubectl_apply(env, body, tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert needle in proc.stderr and "spec.engine." in proc.stderr, proc.stderr
    assert "is refused" in proc.stderr
    assert env.deployment("owned") is None


def _tokens():
    flag = st.sampled_from(sorted(PROTECTED_FLAGS))

    def spell(f, upper, under, cut, no, tail):
        body = f[2:][: max(1, len(f) - 2 - cut)] if cut else f[2:]
        body = body.replace("-", "_") if under else body
        return ("--no-" if no else "--") + (body.upper() if upper else body) + tail

    return st.one_of(
        st.builds(spell, flag, st.booleans(), st.booleans(), st.integers(0, 25), st.booleans(),
                  st.sampled_from(["", "=8", ".a=1", "x"])),
        st.builds(lambda s, t: s + t, st.sampled_from(sorted(PROTECTED_SHORT_FLAGS)),
                  st.sampled_from(["", "=2", "4"])),
        st.text(alphabet="-_=.aceklmnoprstxz19", max_size=14),
    )


def admits_extra_arg(env, token: str) -> bool:
    """Whether the API server admits a spec with ``extraArgs: [token]`` (a server-side
    dry run); a refusal must name the item."""
    body = infdep("cel-probe")
    body["spec"]["engine"]["extraArgs"] = [token]
    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, body,
                                                   dry_run="All")
    except client.ApiException as exc:
        assert exc.status == 422, exc.body
        assert "spec.engine.extraArgs[0]" in exc.body, exc.body
        return False
    return True


@pytest.mark.parametrize(("engine", "admitted"), [
    ({"kvEvents": {"port": 7990}, "dataParallelSize": 16}, False),  # 7990..8005 holds 8000
    ({"kvEvents": {"port": 29500}}, False),
    ({"kvEvents": {"port": 65530}, "dataParallelSize": 8}, False),
    ({"kvEvents": {"port": 80}}, False),
    ({"kvEvents": {"port": 6000}, "dataParallelSize": 8}, True),
    ({"dataParallelSize": 64}, True),  # the default 5557..5620
])
def test_admission_checks_the_kv_event_port_range(env, engine, admitted):
    """The API server's CEL rule and bounds refuse what the model refuses: a KV-event
    port range (base + every data-parallel rank) over the serving or rendezvous port or
    past 65535, naming engine.kvEvents.port."""
    body = infdep("events-port")
    body["spec"]["engine"].update(engine)
    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, body,
                                                   dry_run="All")
    except client.ApiException as exc:
        assert not admitted, exc.body
        assert exc.status == 422 and "kvEvents.port" in exc.body, exc.body
        return
    assert admitted


def test_admission_refuses_exactly_the_flags_the_engine_refuses(env):
    """The CRD's CEL rule is derived from the launcher's own lists: over 150 generated
    tokens (server-side dry run), the API server and refused_flag agree."""

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_tokens())
    def check(token):
        # and vLLM's own refusal of unknown long options (tests/integration/test_extra_args.py)
        assert admits_extra_arg(env, token) == (
            refused_flag(token) is None and not unknown_long_flag(token)
            and not bad_int_value(token)), token

    check()


# ------------------------------------------------------------------ 3: hostile config.json


def _configmap(env, name, text):
    env.core.create_namespaced_config_map(env.ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name), data={"config.json": text}))


def _llama() -> dict:
    from e2e.cluster.controlplane import REPO_ROOT
    from spillway_engine.planner.model_config import load_local

    return load_local(REPO_ROOT / "tests/fixtures/models/llama-3.2-1b.json")


@pytest.mark.local_only  # reads the operator's log
@pytest.mark.parametrize(("text", "reason", "needle", "bugs"), [
    ("[" * 100_000 + "]" * 100_000, "ModelConfigInvalid", "nest", 0),
    (json.dumps({**_llama(), "num_hidden_layers": 10**12}), "OffloadPlanInvalid",
     "num_hidden_layers", 0),
    (json.dumps({**_llama(), "head_dim": 2**60}), "OffloadPlanInvalid", "head_dim", 0),
    (json.dumps({**_llama(), "rope_scaling": {"rope_type": "dynamic", "factor": [2]}}),
     "OffloadPlanInvalid", "not a number", 0),
    # Once a planner crash (float overflow, caught only by the reconciler's catch-all,
    # which tests/unit/operator/flow/test_operator_hostile.py covers); now refused by name,
    # no traceback.
    (json.dumps({**_llama(), "rope_scaling": {"rope_type": "dynamic", "factor": 1e308}}),
     "OffloadPlanInvalid", "rope factor", 0),
], ids=["nested-brackets", "huge-layers", "huge-head-dim", "wrong-type-deep", "absurd-rope"])
def test_hostile_config_json_is_refused_once(env, operator, text, reason, needle, bugs):
    start = len(operator.log_text())
    _configmap(env, "hostile", text)
    env.create(infdep("hostile", config_map="hostile"))
    c = env.wait_condition("hostile", "PlanReady", "False", reason, timeout=30)
    assert needle in c["message"], c["message"]
    assert len(c["message"]) < 1000
    wait_for(lambda: any(e.reason == reason for e in env.events("hostile")), 30, "the Event")
    assert env.deployment("hostile") is None
    # Its own status write re-plans it (and resyncs would): one Event, at most one
    # traceback.
    time.sleep(6)
    text_ = log_since(operator, start)
    assert text_.count("Traceback") == bugs and "RecursionError" not in text_
    assert len([e for e in env.events("hostile") if e.reason == reason]) == 1


# ------------------------------------------------------------------ 4, 5: bad /metrics


class MetricsHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self.server.body
        self.server.hits += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)


GOOD = b"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.4
vllm:num_requests_waiting 0
vllm:num_requests_running 2
vllm:prompt_tokens_total 100
vllm:num_preemptions_total 0
"""


def serve_metrics(ip: str, body: bytes) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((ip, 8000), MetricsHandler)
    server.body, server.hits, server.daemon_threads = body, 0, True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _two_scraped_pods(env, name):
    body = infdep(name, replicas=2, autoscaling={"enabled": True, "minReplicas": 2,
                                                  "maxReplicas": 2, "intervalSeconds": 1})
    env.create(body)
    env.wait_condition(name, "Available", "True", timeout=60)
    pods = wait_for(lambda: [p for p in env.core.list_namespaced_pod(
        env.ns, label_selector=f"spillway.dev/inference-deployment={name}").items
        if p.status.pod_ip and not p.metadata.deletion_timestamp] or None, 30, "pod IPs")
    assert len(pods) == 2
    return sorted(p.status.pod_ip for p in pods), {p.status.pod_ip: p.metadata.name for p in pods}


@pytest.mark.local_only  # binds the pods' loopback IPs
@pytest.mark.parametrize(("bad", "needle"), [
    (GOOD + "é".encode("latin-1") + b"\n", "not UTF-8"),
    (b"vllm:num_requests_running 1\n" * (40 * 2**20 // 28), "body over"),
], ids=["not-utf8", "40MB"])
def test_one_bad_metrics_pod_is_named_and_the_rest_still_scale(env, bad, needle):
    ips, names = _two_scraped_pods(env, "scraped")
    servers = [serve_metrics(ips[0], GOOD), serve_metrics(ips[1], bad)]
    try:
        def measured():
            a = (env.get("scraped").get("status") or {}).get("autoscaling") or {}
            return a if a.get("measuredPods") == 1 and a.get("unmeasuredPods") == 1 else None

        a = wait_for(measured, 30, "status naming the one unmeasured pod",
                     on_timeout=lambda: env.get("scraped").get("status", {}).get("autoscaling"))
        assert a["pressure"] is not None
        assert a["metricsProblems"][0].startswith(names[ips[1]] + ":")
        assert needle in a["metricsProblems"][0]
        assert servers[1].hits >= 1
        # The operator still serves everyone else promptly while it scrapes the bad pod.
        t0 = time.monotonic()
        env.create(infdep("bystander", replicas=0))
        wait_for(lambda: env.deployment("bystander"), 30, "the bystander's Deployment")
        assert time.monotonic() - t0 < 8, f"{time.monotonic() - t0:.1f}s to a Deployment"
        sc = env.condition("scraped", "ScalingActive")
        assert sc and sc["status"] == "True"
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


# ------------------------------------------------------------------ 6: API server outage


@pytest.mark.local_only  # stops and restarts the local kube-apiserver
def test_api_server_outage_logs_one_line_per_object_per_backoff_step(env, cluster, tmp_path):
    """50 objects, an operator resyncing every 2 s, the API server down for 10 s: each
    object logs at most one line per back-off step and there is no traceback."""
    import sys

    from e2e.cluster.controlplane import REPO_ROOT, free_port

    names = [f"o{i:02d}" for i in range(50)]
    for n in names:
        env.create(infdep(n, replicas=0))
    for n in names:
        env.wait_condition(n, "PlanReady", "True", timeout=90)
    log = tmp_path / "outage-operator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway_operator", "-n", env.ns, "--liveness", "",
             "--metrics-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env={**__import__("os").environ, "KUBECONFIG": str(cluster.config.kubeconfig),
                 "PYTHONUNBUFFERED": "1", "SPILLWAY_RESYNC_SECONDS": "2"})
    try:
        wait_for(lambda: "spillway operator started" in log.read_text(errors="replace"), 60,
                 "the outage operator to start")
        time.sleep(4)  # a resync or two of all 50 objects, while the API is up
        before = len(log.read_text(errors="replace"))
        down = cluster.restart_apiserver(10)
        time.sleep(12)  # retries after the outage, and recovery
        text = log.read_text(errors="replace")[before:]
    finally:
        proc.terminate()
        proc.wait(20)
    assert "Traceback" not in text, text[-3000:]
    # Back-off steps in the window (outage + 12 s): 1, 2, 4, 8, 16 s -> at most 5,
    # plus one recovery line.
    per_object = {n: len(lines_about(text, env.ns, n)) for n in names}
    worst = max(per_object.values())
    print(f"outage {down:.1f}s: {len(text.splitlines())} log lines in all, at most {worst} "
          f"per object ({sum(per_object.values())} about objects)")
    assert worst <= 6, per_object
    assert len(text.splitlines()) <= 6 * len(names) + 100, text[-3000:]
    for n in names[:5]:
        env.wait_condition(n, "PlanReady", "True", timeout=60)


# ------------------------------------------------------------------ fuzz: the spec


def _hostile_strings():
    return st.sampled_from([
        "", " ", "a" * 5000, "\u202e\u0000nul", "../../etc/passwd", "$(rm -rf /)", "{{x}}",
        "é", "😀" * 50, "-", "--", "a/..", "a/b.git", "0", "-1", "1e400", "auto", "Ki", "1Ei",
        "99999999999999999999Ei", "NaN", "true", "\n", "x" * 300,
    ])


def _strategy(schema: dict, depth: int = 0):
    """Values for one node of the CRD schema (itself generated from spec.py): valid ones,
    ones just past each bound, wrong types and hostile strings."""
    if "enum" in schema:
        return st.sampled_from([*schema["enum"], "bogus", ""])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 2**31)
        return st.one_of(st.integers(lo, min(hi, lo + 4)),
                         st.sampled_from([lo - 1, hi, hi + 1, 2**63 - 1, -(2**63)]),
                         _hostile_strings())
    if kind == "number":
        lo, hi = schema.get("minimum", 0.0), schema.get("maximum", 1e9)
        return st.one_of(st.floats(lo, hi, allow_nan=False),
                         st.sampled_from([lo, hi, hi + 0.01, lo - 0.01, 1e308, -1e308]))
    if kind == "boolean":
        return st.one_of(st.booleans(), st.sampled_from(["yes", 1]))
    if kind == "string":
        options = [_hostile_strings()]
        if "pattern" in schema:
            options.append(st.from_regex(schema["pattern"], fullmatch=True).map(
                lambda s: s[:300]))
        if "default" in schema:
            options.append(st.just(schema["default"]))
        return st.one_of(*options)
    if kind == "array":
        item = _strategy(schema.get("items", {}), depth + 1)
        return st.lists(item, max_size=min(schema.get("maxItems", 3) + 1, 4))
    if schema.get("x-kubernetes-preserve-unknown-fields") or (
            kind == "object" and "properties" not in schema):
        return st.one_of(st.just({}), st.dictionaries(st.sampled_from(["a", "key", "x-y"]),
                                                      _hostile_strings(), max_size=2))
    if kind == "object" and depth < 4:
        props = schema["properties"]
        return st.fixed_dictionaries({}, optional={
            k: _strategy(v, depth + 1) for k, v in props.items()})
    return st.none()


def _spec_strategy():
    from spillway_operator.flow import crd

    schema = crd.spec_schema()
    fields = {k: _strategy(v) for k, v in schema["properties"].items()
              if k not in ("model", "replicas")}
    model = _strategy(schema["properties"]["model"]["properties"]["name"])
    return st.fixed_dictionaries(
        {"model": st.builds(lambda n: {"name": n, "configMapRef": {"name": "model"}},
                            st.one_of(st.just("google/gemma-3-1b-it"), model)),
         # Valid replica counts stay small: KWOK would run up to 1000 pods otherwise.
         "replicas": st.sampled_from([0, 1, -1, 1001, 2**40, "1"])},
        optional=fields)


def _one_field_strategy():
    """A valid spec with one or two fields replaced by generated values: most reach
    the operator, so the planner and the API server's checks on children get hit."""
    from spillway_operator.flow import crd

    schema = crd.spec_schema()
    choices = []
    for section, sub in schema["properties"].items():
        if section == "model":
            choices += [st.tuples(st.just(section), st.just(k), _strategy(v))
                        for k, v in sub["properties"].items() if k != "configMapRef"]
        elif "properties" in sub:
            choices += [st.tuples(st.just(section), st.just(k), _strategy(v))
                        for k, v in sub["properties"].items()]
        elif section != "replicas":
            choices.append(st.tuples(st.just(section), st.none(), _strategy(sub)))

    def apply(changes):
        spec = {"model": {"name": "google/gemma-3-1b-it", "configMapRef": {"name": "model"}},
                "replicas": 1, "offload": {"hostMemory": "16Gi"}}
        for section, key, value in changes:
            if key is None:
                spec[section] = value
            else:
                spec.setdefault(section, {})[key] = value
        return spec

    return st.lists(st.one_of(choices), min_size=1, max_size=2).map(apply)


TERMINAL_TIMEOUT = 30
FUZZ_EXAMPLES = 300
FUZZ_BUDGET_S = 100


@pytest.mark.local_only  # reads the operator's log
def test_fuzzed_specs_are_refused_by_field_or_reach_a_terminal_condition(env, operator):
    """Generated InferenceDeployments against the real API server and operator: either
    admission refuses one naming a field, or the operator reaches a terminal PlanReady
    (no retrying reason) within 30 s, with no traceback and no pods for a refused plan.
    300 examples within a 100 s budget (examples past the budget are skipped and
    counted)."""
    start_log = len(operator.log_text())
    started = time.monotonic()
    seen = {"refused": 0, "planned": 0, "plan_refused": 0, "skipped": 0}
    counter = iter(range(10_000))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(_spec_strategy(), _one_field_strategy()))
    def check(spec):
        if time.monotonic() - started > FUZZ_BUDGET_S:
            seen["skipped"] += 1
            return
        name = f"fz{next(counter)}"
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
                "metadata": {"name": name}, "spec": spec}
        try:
            env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, body)
        except client.ApiException as exc:
            assert exc.status in (400, 422), (exc.status, exc.body)
            assert re.search(r"spec(\.|\[|:| )|\.spec", exc.body or ""), exc.body
            seen["refused"] += 1
            return
        except ValueError:  # the client refuses to send it (e.g. not JSON-serialisable)
            seen["refused"] += 1
            return
        try:
            def terminal():
                c = env.condition(name, "PlanReady")
                return c if c and c["reason"] != "ModelConfigUnavailable" else None

            c = wait_for(terminal, TERMINAL_TIMEOUT, f"a terminal PlanReady on {name}",
                         on_timeout=lambda: (env.get(name).get("status"), spec))
            if c["status"] == "False":
                seen["plan_refused"] += 1
                assert env.deployment(name) is None, spec
                assert not env.core.list_namespaced_pod(
                    env.ns, label_selector=f"spillway.dev/inference-deployment={name}").items
            else:
                seen["planned"] += 1
        finally:
            env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)

    check()
    took = time.monotonic() - started
    print(f"spec fuzz: {sum(seen.values())} examples in {took:.0f}s: {seen}")
    text = log_since(operator, start_log)
    assert "Traceback" not in text, text[-4000:]
