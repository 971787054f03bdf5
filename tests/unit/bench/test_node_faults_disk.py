"""bench.node_faults' disk fault: the tier it installs is one the operator accepts and
plans, and both replicas' shares fit the volume it fills, so nothing but the fault's
own fill makes a store fail."""

from __future__ import annotations

import yaml

from bench import node_faults
from bench import node_faults_disk as disk
from e2e import install
from spillway_engine.emulator.tiny import qwen3_next_config
from spillway_engine.planner.plan import make_plan
from spillway_engine.quantity import parse_bytes
from spillway_operator.flow import render
from spillway_operator.flow.spec import InferenceDeploymentSpec


def test_the_disk_fault_installs_a_tier_the_operator_plans_within_its_volume():
    obj = install.on_real_nodes(yaml.safe_load(node_faults.SAMPLE.read_text()), "engine:x",
                                "models")
    obj["spec"]["replicas"] = 2
    obj["spec"]["autoscaling"] = {"enabled": False}
    obj["spec"]["offload"]["disk"] = disk.offload_disk()
    spec = InferenceDeploymentSpec.model_validate(obj["spec"])
    pv, claim = disk.objects(node_faults.SERVING)
    assert claim["spec"]["volumeName"] == pv["metadata"]["name"]
    assert render.disk_claim_refusal(spec, claim) is None
    plan = make_plan(qwen3_next_config(num_layers=4),
                     spec.plan_request().model_copy(update={"disk_writers": spec.disk_writers}))
    assert plan.disk is not None and plan.disk.capacity_tokens > 0
    assert spec.disk_writers * plan.disk.budget_bytes_per_engine * plan.pod.engines \
        <= parse_bytes(disk.SIZE)
    assert "disk" in node_faults.FAULTS
