"""spillway_operator.flow.scaler: one record per object, the body kept once, and a pod
whose counters go bad: unmeasured, no scaling on it, one log line per episode."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spillway_engine.metrics import INTER_TOKEN_LATENCY_BUCKETS
from spillway_operator.flow.pressure import State
from spillway_operator.flow.scaler import Autoscaler, Scrape, Tracked
from spillway_operator.flow.spec import InferenceDeploymentSpec
from spillway_operator.plumbing import metrics

KEY = ("team-a", "chat")


def infdep(replicas: int = 2, **autoscaling: Any) -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "team-a", "uid": "u"},
            "spec": {"model": {"name": "meta-llama/Llama-3.2-1B"}, "replicas": replicas,
                     "autoscaling": {"enabled": True, "minReplicas": 1, **autoscaling}},
            "status": {"observedGeneration": 1, "plan": {"gpu": "h100"}}}


def pod(name: str, ip: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


class FakeKube:
    def __init__(self, obj: dict[str, Any], pods: list[dict[str, Any]]):
        self.obj, self.pods = obj, pods
        self.writes: list[tuple[str, Any]] = []

    def namespace_terminating(self, namespace: str) -> bool:
        return False

    def pods_of(self, namespace: str, name: str, selector: str) -> list[dict[str, Any]]:
        return self.pods

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self.writes.append(("scale", replicas))
        self.obj["spec"]["replicas"] = replicas

    def post_event(self, *args: Any) -> None:
        self.writes.append(("event", args[-1]))

    def annotate_pod(self, namespace: str, pod: str, annotations: dict) -> None:
        self.writes.append(("annotate", pod))

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self.writes.append(("status", status))
        self.obj["status"] = merged(self.obj.get("status") or {}, status)


def merged(target: Any, patch: Any) -> Any:
    """RFC 7386: what the API server makes of a JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merged(out.get(k), v)
    return out


def engine_text(t: float, *, tokens: float, kv: float = 0.2, running: int = 2,
                buckets: int | None = None) -> bytes:
    """An engine's /metrics after ``t`` seconds of serving ``tokens`` tokens/s."""
    gen = tokens * t
    bounds = [float(b) for b in INTER_TOKEN_LATENCY_BUCKETS][:buckets]
    lines = [
        f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}',
        'vllm:num_requests_waiting{engine="0"} 0',
        f'vllm:num_requests_running{{engine="0"}} {running}',
        f'vllm:prompt_tokens_total{{engine="0"}} {2 * gen}',
        'vllm:num_preemptions_total{engine="0"} 0',
        f'vllm:generation_tokens_total{{engine="0"}} {gen}',
        f'vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} {gen}',
        "# TYPE vllm:inter_token_latency_seconds histogram",
    ]
    lines += [f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="{b}"}} '
              f'{gen if b >= 0.01 else 0}' for b in bounds]
    lines += [f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf"}} {gen}',
              f'vllm:inter_token_latency_seconds_count{{engine="0"}} {gen}',
              f'vllm:inter_token_latency_seconds_sum{{engine="0"}} {gen * 0.01}']
    return ("\n".join(lines) + "\n").encode()


def run_ticks(scaler: Autoscaler, obj: dict[str, Any], bodies: list[dict[str, bytes]],
              start: float = 0.0) -> None:
    """One tick per entry of ``bodies`` (pod name -> /metrics), 15 s apart."""
    spec = InferenceDeploymentSpec.model_validate(obj["spec"])

    async def go():
        for i, texts in enumerate(bodies):
            async def scrape(name: str, ip: str, texts=texts) -> Scrape:
                return Scrape(name, body=texts[name])
            scaler._scrape = scrape  # type: ignore[method-assign]
            await scaler.tick(KEY, obj, spec, start + 15.0 * i)
        await scaler.stop()

    asyncio.run(go())


def test_one_record_per_object_created_and_dropped_in_one_place():
    async def scenario():
        s = Autoscaler(FakeKube(infdep(), []))
        s.observe(KEY, infdep())
        rec = s.objects[KEY]
        assert isinstance(rec, Tracked) and s.bodies[KEY]["metadata"]["name"] == "chat"
        rec.state, rec.samples, rec.exported = State(observing_since=1.0), {"p": None}, True
        metrics.OFFLOAD_PRESSURE.labels(*KEY).set(0.5)
        s.activate()  # a new leader: the record's readings start afresh
        assert s.objects[KEY] is rec and rec.state is None and rec.samples == {}
        assert set(s._tasks) == {KEY}
        s.observe(KEY, None)  # deleted: the record, its loop and its series go at once
        assert KEY not in s.objects and KEY not in s.bodies
        assert KEY not in {tuple(m.labels.values()) for f in metrics.OFFLOAD_PRESSURE.collect()
                           for m in f.samples}
        await s.stop()

    asyncio.run(scenario())


def test_the_body_is_kept_once_with_the_controller():
    from spillway_operator.controller import Controller

    s = Autoscaler(FakeKube(infdep(), []))
    c = Controller(reconciler=None, autoscaler=s)  # type: ignore[arg-type]
    c.observe(infdep(), "ADDED")
    assert s.bodies is c.objects and KEY in s.objects
    assert not any(hasattr(r, "body") for r in s.objects.values())
    c.observe(infdep(), "DELETED")
    assert KEY not in s.objects and KEY not in c.objects


def test_a_restarted_pod_is_unmeasured_scales_nothing_and_is_logged_once(caplog):
    """Pod b restarts (its counters start again from 0, its histogram with fewer
    buckets) and stays bad for three ticks while a is idle: b is listed as unmeasured,
    nothing is scaled down meanwhile, one warning is logged for the episode and one line
    when b is measured again; then the idle fleet scales down."""
    obj = infdep(replicas=2, scaleDownStabilizationSeconds=0)
    kube = FakeKube(obj, [pod("a", "10.0.0.1"), pod("b", "10.0.0.2")])
    scaler = Autoscaler(kube)
    caplog.set_level("INFO", logger="spillway.scaler")
    first = [{"a": engine_text(100.0, tokens=10.0), "b": engine_text(100.0, tokens=10.0)}]
    restarted = [{"a": engine_text(t, tokens=10.0), "b": engine_text(t - 114.0, tokens=10.0)}
                 for t in (115.0, 130.0, 145.0)]
    restarted[1]["b"] = engine_text(16.0, tokens=10.0, buckets=10)  # and lost buckets
    back = [{"a": engine_text(t, tokens=10.0), "b": engine_text(t - 114.0, tokens=10.0)}
            for t in (160.0, 175.0, 190.0, 205.0)]
    statuses: list[dict[str, Any]] = []
    real = kube.patch_status

    def patch_status(namespace: str, name: str, status: dict) -> None:
        real(namespace, name, status)
        statuses.append(dict(obj["status"]["autoscaling"]))

    kube.patch_status = patch_status  # type: ignore[method-assign]
    run_ticks(scaler, obj, first + restarted + back)
    scales = [i for i, w in enumerate(kube.writes) if w[0] == "scale"]
    bad = [st for st in statuses if st.get("unmeasuredPods") == 1]
    assert bad and all(st["metricsProblems"][0].startswith("b: ") for st in bad)
    assert "backwards" in bad[0]["metricsProblems"][0]
    assert all(st["lastDecision"] != "scale-down" for st in bad)
    assert scales and kube.writes[scales[0]] == ("scale", 1)  # once b is measured again
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "pod b unmeasured: counter_reset" in warnings[0], warnings
    assert sum("pod b measured again" in r.getMessage() for r in caplog.records) == 1


def test_the_status_says_the_term_and_the_learned_serving_rate():
    obj = infdep(replicas=1)
    kube = FakeKube(obj, [pod("a", "10.0.0.1")])
    scaler = Autoscaler(kube)
    run_ticks(scaler, obj, [{"a": engine_text(t, tokens=10.0)} for t in (100.0, 115.0, 130.0)])
    auto = obj["status"]["autoscaling"]
    assert auto["lastDecisionTerm"] in ("throughput", "load", "queue", "thrash", "preempt")
    rate = auto["servingRate"]
    assert rate["prefillTokensPerSecond"] > 0 and rate["learnedIntervals"] > 0
    assert "throughput" in auto["components"]


@pytest.mark.parametrize(("field", "value"), [
    ("rateHalfLifeSeconds", -1), ("rateHalfLifeSeconds", 3601),
    ("forecastWindowSeconds", 29), ("forecastWindowSeconds", 1801),
    ("servingRateHalfLifeSeconds", 59), ("servingRateHalfLifeSeconds", 86401),
])
def test_a_knob_outside_its_bounds_is_refused(field, value):
    """The API server refuses it (the CRD's schema carries the bounds), and so does the
    operator's model of the spec."""
    from pydantic import ValidationError

    from spillway_operator.flow import crd

    props = crd.spec_schema()["properties"]["autoscaling"]["properties"][field]
    assert props["minimum"] <= props["default"] <= props["maximum"]
    assert not props["minimum"] <= value <= props["maximum"]
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate(
            {"model": {"name": "a/b"}, "autoscaling": {field: value}})
