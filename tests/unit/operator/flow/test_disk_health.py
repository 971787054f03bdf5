"""The disk tier's failing stores, from the pods' counters to status.diskTier and the
Degraded condition (issue 48 item 3): said while failures grow, cleared when a store
succeeds or nothing fails for the hold window, and nothing written in steady state."""

from __future__ import annotations

from typing import Any

from spillway_operator.controller import only_status_changed
from spillway_operator.flow.disk_health import PodDisk, assess, degraded_message, hold_seconds
from spillway_operator.flow.pressure import Sample, parse_metrics
from spillway_operator.flow.scaler import Autoscaler
from spillway_operator.flow.status import Observed, build_status, read_status
from spillway_operator.flow.status_model import DiskTierStatus, InferenceDeploymentStatus

from .test_scaler import FakeKube, engine_text, infdep, pod, run_ticks

HOLD = hold_seconds(15.0)


def sample(t: float, failures: float | None, stores: float = 0.0) -> Sample:
    values = {} if failures is None else {"disk_write_failures": failures,
                                          "disk_stores": stores}
    return Sample(t, values)


def ticks(readings: list[dict[str, Sample]], ready: list[str], listed: list[str] = ()
          ) -> list[DiskTierStatus | None]:  # fmt: skip
    """Run ``assess`` over the readings 15 s apart, feeding its status back as the live one."""
    seen: dict[str, PodDisk] = {}
    out: list[DiskTierStatus | None] = []
    names = list(listed)
    for i, cur in enumerate(readings):
        seen, status = assess(seen, cur, ready, names, 15.0 * i, HOLD)
        names = list(status.failing_pods or []) if status else []
        out.append(status)
    return out


def test_the_counters_are_read_from_the_engines_metrics_summed_over_engines():
    text = ("spillway_disk_tier_write_failures_total{engine=\"0\"} 3\n"
            "spillway_disk_tier_write_failures_total{engine=\"1\"} 4\n"
            "spillway_disk_tier_stores_total{engine=\"0\"} 10\n")
    got = parse_metrics(text, 1.0).values
    assert got["disk_write_failures"] == 7 and got["disk_stores"] == 10


def test_failures_growing_make_a_pod_failing_and_a_store_that_succeeds_clears_it():
    out = ticks([
        {"a": sample(0, 0, 5), "b": sample(0, 0, 5)},
        {"a": sample(15, 4, 5), "b": sample(15, 0, 9)},  # a's disk refuses its stores
        {"a": sample(30, 6, 5), "b": sample(30, 0, 12)},
        {"a": sample(45, 6, 7), "b": sample(45, 0, 12)},  # a store succeeded: recovered
    ], ready=["a", "b"])
    assert out[0] is None
    assert out[1] == DiskTierStatus(failing_pods=["a"], write_failures=4)
    assert out[2] == DiskTierStatus(failing_pods=["a"], write_failures=2)
    assert out[3] is None


def test_a_backing_off_tier_stays_failing_for_the_hold_window_then_clears():
    """The engine backs off up to 30 s between tries: an interval without a new failure
    (and without a store) is not a recovery, until the hold window has passed."""
    quiet = [{"a": sample(15.0 * i, 3, 1)} for i in range(2, 9)]
    out = ticks([{"a": sample(0, 0, 1)}, {"a": sample(15, 3, 1)}, *quiet], ready=["a"])
    held = [s is not None for s in out]
    assert held[1] and held[2] and held[1 + int(HOLD // 15)]
    assert held[-1] is False and out[2] == DiskTierStatus(failing_pods=["a"], write_failures=0)


def test_no_disk_tier_and_steady_counters_say_nothing():
    assert ticks([{"a": sample(0, None)}, {"a": sample(15, None)}], ready=["a"]) == [None, None]
    assert ticks([{"a": sample(0, 2, 9)}, {"a": sample(15, 2, 9)}], ready=["a"]) == [None, None]


def test_a_pod_without_a_pair_keeps_what_the_status_said():
    """A new leader (no memory), a scrape that failed, an engine restart: the live status
    is neither cleared nor invented; a pod that is no longer ready is dropped."""
    seen, status = assess({}, {"a": sample(0, 9, 1), "b": sample(0, 9, 1)}, ["a", "b"],
                          ["a"], 0.0, HOLD)
    assert status == DiskTierStatus(failing_pods=["a"], write_failures=0)
    seen, status = assess(seen, {"b": sample(15, 9, 1)}, ["a", "b"], ["a"], 15.0, HOLD)
    assert status is not None and status.failing_pods == ["a"]  # a unscraped: kept
    seen, status = assess(seen, {"a": sample(30, 0, 0)}, ["a"], ["a"], 30.0, HOLD)
    assert status is not None and status.failing_pods == ["a"]  # restarted: kept
    _, status = assess(seen, {"b": sample(45, 9, 1)}, ["b"], ["a"], 45.0, HOLD)
    assert status is None  # a is gone


def observed() -> Observed:
    dep = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                      "updatedReplicas": 2, "availableReplicas": 2}}
    return Observed(generation=1, desired_replicas=2, deployment=dep)


def conditions(status: InferenceDeploymentStatus) -> dict[str, Any]:
    return {c.type: c for c in status.conditions}


def test_the_degraded_condition_names_the_failing_pods_and_clears():
    failing = InferenceDeploymentStatus(disk_tier=DiskTierStatus(
        failing_pods=["chat-a", "chat-b"], write_failures=12))
    first = build_status(observed(), failing, now="2026-01-01T00:00:00Z")
    got = conditions(first)
    degraded = got["Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "DiskTierWriteFailing")
    assert "chat-a, chat-b" in degraded.message and "serving goes on" in degraded.message
    assert got["Available"].status == "True"  # serving goes on
    # More failures on the same pods: the same condition, so the same status (no write).
    more = first.model_copy(update={"disk_tier": DiskTierStatus(
        failing_pods=["chat-a", "chat-b"], write_failures=40)})
    assert build_status(observed(), more, now="2026-01-01T00:01:00Z").conditions == \
        first.conditions
    cleared = conditions(build_status(observed(), InferenceDeploymentStatus()))
    assert (cleared["Degraded"].status, cleared["Degraded"].reason) == ("False", "AsExpected")


def test_the_message_names_a_few_pods():
    msg = degraded_message(DiskTierStatus(failing_pods=[f"p{i}" for i in range(8)]))
    assert "p0, p1, p2, p3, p4 and 3 more" in msg


def test_a_disk_tier_change_is_for_the_reconciler_to_follow():
    body = {"metadata": {"generation": 1}, "spec": {}, "status": {"observedGeneration": 1}}
    failing = {**body, "status": {**body["status"], "diskTier": {"failingPods": ["a"]}}}
    assert not only_status_changed(body, failing)
    assert only_status_changed(failing, {**failing, "status": {**failing["status"], "x": 1}})


def disk_text(t: float, failures: int, stores: int) -> bytes:
    return engine_text(t, tokens=10.0) + (
        "spillway_disk_tier_budget_bytes{engine=\"0\"} 1048576\n"
        f"spillway_disk_tier_write_failures_total{{engine=\"0\"}} {failures}\n"
        f"spillway_disk_tier_stores_total{{engine=\"0\"}} {stores}\n").encode()


def test_the_autoscaler_writes_disk_tier_while_failing_removes_it_after_and_is_silent():
    obj = infdep(replicas=2)
    obj["spec"]["autoscaling"]["enabled"] = False  # said whether or not it scales
    kube = FakeKube(obj, [pod("a", "10.0.0.1"), pod("b", "10.0.0.2")])
    counts = [(0, 5), (0, 5), (4, 5), (9, 5), (9, 8), (9, 8), (9, 8)]  # a: (failures, stores)
    bodies = [{"a": disk_text(100.0 + 15 * i, f, s), "b": disk_text(100.0 + 15 * i, 0, 3)}
              for i, (f, s) in enumerate(counts)]
    seen: list[Any] = []
    real = kube.patch_status

    def patch_status(namespace: str, name: str, status: dict) -> None:
        real(namespace, name, status)
        seen.append((status.get("diskTier", "-"), dict(obj["status"]).get("diskTier")))

    kube.patch_status = patch_status  # type: ignore[method-assign]
    run_ticks(Autoscaler(kube), obj, bodies)
    disk_writes = [live for patch, live in seen if patch != "-"]
    assert disk_writes == [{"failingPods": ["a"], "writeFailures": 4},
                           {"failingPods": ["a"], "writeFailures": 5}, None]
    assert "diskTier" not in obj["status"]
    assert read_status(obj["status"]).disk_tier is None
    # The last two ticks changed nothing: no write at all.
    before = len(seen)
    run_ticks(Autoscaler(kube), obj, [bodies[-1], bodies[-1]], start=200.0)
    assert [p for p, _ in seen[before:] if p != "-"] == []
