"""Spillway's own metric definitions (spillway_engine.metrics)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spillway_engine.metrics import (
    METRIC_NAMES,
    PLAN_INFO_LABELS,
    build_spillway_metrics,
    plan_info_labels,
)
from spillway_engine.planner.plan import Plan
from tests.unit.simulator_support import GEMMA, LLAMA, plan_dict


def families(registry):
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams, name, **labels):
    for s in fams[name].samples:
        if s.name.endswith("_created"):
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(name)


def test_families_names_types_and_base_labels():
    registry = CollectorRegistry()
    build_spillway_metrics(registry, "m", "0")
    fams = families(registry)
    assert set(METRIC_NAMES) <= set(fams)
    assert all(name.startswith("spillway_") for name in METRIC_NAMES)
    assert fams["spillway_host_pool_evictions"].type == "counter"
    assert fams["spillway_host_pool_thrash"].type == "counter"
    assert fams["spillway_host_pool_used_chunks"].type == "gauge"
    for name in METRIC_NAMES:
        if name == "spillway_plan_info":
            continue  # appears once a plan is set
        labels = {k for s in fams[name].samples for k in s.labels}
        assert labels == {"model_name", "engine"}, name


def test_plan_info_and_capacity_from_a_real_plan():
    registry = CollectorRegistry()
    metrics = build_spillway_metrics(registry, "meta-llama/Llama-3.2-1B")
    plan = plan_dict(LLAMA)
    metrics.set_plan(Plan.model_validate(plan))
    fams = families(registry)
    assert value(fams, "spillway_host_pool_capacity_chunks") == plan["num_chunks"]
    assert value(fams, "spillway_host_pool_capacity_tokens") == plan["capacity_tokens"]
    (info,) = fams["spillway_plan_info"].samples
    assert info.value == 1
    assert info.labels["model"] == "meta-llama/Llama-3.2-1B"
    assert info.labels["gpu"] == plan["gpu"]["name"]
    assert info.labels["offloader"] == "upstream"
    assert info.labels["blocks_per_chunk"] == "16"
    assert info.labels["num_chunks"] == str(plan["num_chunks"])
    assert info.labels["group_kinds"] == "full_attention"
    assert set(info.labels) == {"model_name", "engine", *PLAN_INFO_LABELS}


def test_plan_info_labels_of_a_plan():
    gemma = plan_info_labels(Plan.model_validate(plan_dict(GEMMA)))
    assert list(gemma) == list(PLAN_INFO_LABELS)
    assert gemma["num_groups"] == "7" and gemma["offloader"] == "spillway"
    assert gemma["tensor_parallel_size"] == "1" and gemma["model"] == "google/gemma-3-1b-it"


def test_counters_and_fill():
    registry = CollectorRegistry()
    metrics = build_spillway_metrics(registry, "m", "3")
    metrics.add(evictions=5, thrash=2, lookup_tokens=100, hit_tokens=40)
    metrics.add(evictions=1)
    metrics.set_fill(used_chunks=7, tokens=1792)
    fams = families(registry)
    assert value(fams, "spillway_host_pool_evictions", engine="3") == 6
    assert value(fams, "spillway_host_pool_thrash") == 2
    assert value(fams, "spillway_host_lookup_tokens") == 100
    assert value(fams, "spillway_host_hit_tokens") == 40
    assert value(fams, "spillway_host_pool_used_chunks") == 7
    assert value(fams, "spillway_host_pool_tokens") == 1792


def test_registries_are_independent():
    a, b = CollectorRegistry(), CollectorRegistry()
    build_spillway_metrics(a, "m").add(evictions=3)
    build_spillway_metrics(b, "m")
    assert value(families(b), "spillway_host_pool_evictions") == 0
    with pytest.raises(ValueError):  # duplicated on one registry
        build_spillway_metrics(a, "m")
