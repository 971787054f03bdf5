"""Speculative decoding through the API server and the operator: admission (CEL) and the
plan that holds the drafter's KV-cache layers, with the drafter's config.json read from
its own ConfigMap."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from e2e.cluster.controlplane import REPO_ROOT
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.helpers import wait_for
from tests.integration.test_operator import Env, infdep

pytestmark = pytest.mark.usefixtures("operator")

FRONTIER = REPO_ROOT / "tests" / "contract" / "frontier_configs"


def _configmap(env: Env, name: str, fixture: str) -> None:
    from spillway_engine.planner.model_config import load_local

    config = load_local(FRONTIER / fixture)
    env.core.create_namespaced_config_map(env.ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name), data={"config.json": json.dumps(config)}))


@pytest.fixture
def env(api, namespace, cluster):
    e = Env(api, namespace, cluster)
    _configmap(e, "model", "qwen3-8b.json")
    _configmap(e, "drafter", "qwen3-0.6b.json")
    return e


def _speculative(name: str, speculative: dict) -> dict:
    body = infdep(name, engine={"maxModelLen": 8192, "speculative": speculative})
    body["spec"]["model"]["name"] = "Qwen/Qwen3-8B"
    return body


@pytest.mark.parametrize("speculative", [
    {"method": "eagle3", "numSpeculativeTokens": 3},
    {"method": "draft_model", "numSpeculativeTokens": 3},
    {"method": "mtp", "numSpeculativeTokens": 1, "model": {"name": "Qwen/Qwen3-0.6B"}},
])
def test_admission_wants_a_drafter_exactly_for_draft_model_and_eagle3(env, speculative):
    with pytest.raises(client.ApiException) as refused:
        env.custom.create_namespaced_custom_object(
            GROUP, VERSION, env.ns, PLURAL, _speculative("probe", speculative), dry_run="All")
    assert refused.value.status == 422
    assert "engine.speculative.model is required for draft_model and eagle3" in refused.value.body


def test_operator_plans_the_drafter_and_the_pod_gets_it(env):
    env.create(_speculative("drafted", {
        "method": "draft_model", "numSpeculativeTokens": 4,
        "model": {"name": "Qwen/Qwen3-0.6B", "configMapRef": {"name": "drafter"}},
    }))
    env.wait_condition("drafted", "PlanReady", "True")
    plan = json.loads(env.core.read_namespaced_config_map("drafted-plan", env.ns)
                      .data["plan.json"])
    assert plan["speculative_method"] == "draft_model"
    assert plan["speculative_model"] == "Qwen/Qwen3-0.6B"
    assert plan["num_speculative_tokens"] == 4
    # Qwen3-0.6B's 28 layers (8 x 128, the 8B's page) join the 8B's 36 in one group
    assert plan["draft_layer_indices"] == list(range(36, 64))
    assert [g["num_layers"] for g in plan["kv_groups"]] == [64]
    wait_for(lambda: env.deployment("drafted"), 60, "the Deployment")
