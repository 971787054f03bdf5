"""The chart's NetworkPolicy for the engine pods (templates/engine-networkpolicy.yaml):
off by default; on, it admits exactly the ports the operator declares on the engine
pods it renders (http and one KV-event port per data-parallel rank), from the peers
given, in each namespace named; the values schema and the template refuse what cannot
be a policy. Rendered with the pinned helm (``helm template`` and ``helm lint
--strict``: no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway_engine.planner.model_config import load_local
from spillway_engine.planner.plan import make_plan
from spillway_operator.flow import render as operator_render
from spillway_operator.flow.spec import InferenceDeploymentSpec
from tests.integration.test_chart import (  # noqa: F401 (fixtures)
    CHART,
    RELEASE,
    bins,
    by_kind,
    helm,
    helm_env,
    render,
)

pytestmark = pytest.mark.local_only

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def engine_pod_ports(engine: dict) -> set[int]:
    """The container ports of the engine pod the operator renders for ``engine``."""
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"name": "meta-llama/Llama-3.2-1B"}, "engine": engine})
    plan = make_plan(load_local(MODELS / "llama-3.2-1b.json"), spec.plan_request())
    dep = operator_render.deployment(operator_render.Owner("chat", "a", "uid"), spec, plan)
    [container] = dep["spec"]["template"]["spec"]["containers"]
    return {p["containerPort"] for p in container["ports"]}


def allowed(policy: dict) -> set[int]:
    """The TCP ports the policy's ingress rules admit (port .. endPort)."""
    out: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        for p in rule["ports"]:
            assert p["protocol"] == "TCP"
            out |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
    return out


def test_engine_network_policy_is_off_by_default(helm):  # noqa: F811 (the fixture)
    assert not by_kind(render(helm, "models"), "NetworkPolicy")


def test_engine_network_policy_admits_exactly_the_declared_ports(helm):  # noqa: F811 (the fixture)
    (policy,) = by_kind(render(helm, "models", "engineNetworkPolicy.enabled=true"),
                        "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "models"
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "spillway-engine"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert allowed(policy) == engine_pod_ports({}) == {8000, 5557}
    [rule] = policy["spec"]["ingress"]
    assert "from" not in rule  # no peers given: any source, on those ports only

    # four ranks from 6000, in two namespaces, from the router's pods only
    docs = render(helm, "ops", "engineNetworkPolicy.enabled=true",
                  "engineNetworkPolicy.kvEventsPort=6000",
                  "engineNetworkPolicy.dataParallelRanks=4",
                  "engineNetworkPolicy.namespaces={team-a,team-b}",
                  "engineNetworkPolicy.from[0].podSelector.matchLabels.app\\.kubernetes\\.io/"
                  "name=spillway-router")
    policies = by_kind(docs, "NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["team-a", "team-b"]
    declared = engine_pod_ports({"dataParallelSize": 4, "kvEvents": {"port": 6000}})
    for policy in policies:
        assert allowed(policy) == declared == {8000, 6000, 6001, 6002, 6003}
        [rule] = policy["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "spillway-router"}}}]


def test_engine_network_policy_values_are_checked(helm):  # noqa: F811 (the fixture)
    out = helm("lint", "--strict", CHART, "--set", "engineNetworkPolicy.enabled=true",
               "--set", "engineNetworkPolicy.dataParallelRanks=8").stdout
    assert "0 chart(s) failed" in out, out
    for bad, words in (("engineNetworkPolicy.kvEventsPort=80", "minimum"),
                       ("engineNetworkPolicy.dataParallelRanks=0", "minimum"),
                       ("engineNetworkPolicy.bogus=1", "additional properties"),
                       ("engineNetworkPolicy.kvEventsPort=65530,engineNetworkPolicy."
                        "dataParallelRanks=8,engineNetworkPolicy.enabled=true", "at most 65535")):
        proc = helm("template", RELEASE, CHART, "--set", bad, check=False)
        assert proc.returncode != 0 and words in proc.stderr, (bad, proc.stderr[-500:])
