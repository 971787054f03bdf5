"""Hostile input to the operator's pure parts: the spec's guards agree with what the
engine and the hub accept, and a planner crash is refused once, never retried."""

from __future__ import annotations

import re
import string

import pytest
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spillway_engine.seam import PROTECTED_FLAGS, PROTECTED_SHORT_FLAGS, refused_flag
from spillway_engine.vllm_cli import one_line, refusal
from spillway_operator.flow import crd, reconciler
from spillway_operator.flow.cel import CEL_RULES
from spillway_operator.flow.spec import EngineSpec, InferenceDeploymentSpec, ModelSpec
from spillway_operator.flow.spec_input import (
    MODEL_ID_PATTERN,
    PLAN_ENV_OWNERS,
    RESERVED_ENV_NAMES,
)


def hub_accepts(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def we_accept(name: str) -> bool:
    try:
        ModelSpec(name=name)
    except ValidationError:
        return False
    return True


def test_the_crd_carries_the_model_id_pattern_and_rules():
    model = crd.spec_schema()["properties"]["model"]
    assert model["properties"]["name"]["pattern"] == MODEL_ID_PATTERN
    assert model["properties"]["name"]["maxLength"] == 193
    rules = " ".join(r["rule"] for r in model["x-kubernetes-validations"])
    assert "size(p) <= 96" in rules and ".git" in rules


_near = st.text(alphabet="ab9_-./", min_size=1, max_size=14)
_long = st.builds(lambda a, b, sep: "x" * a + sep + "y" * b, st.integers(1, 100),
                  st.integers(0, 100), st.sampled_from(["/", "-", ".", ""]))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_near, _long, st.text(max_size=40),
                 st.text(alphabet=string.printable, max_size=30)))
@example("a/..")
@example("a/b.git")
@example("Qwen/Qwen3-Next-80B-A3B-Instruct")
@example("a-.b")
@example("_a/b_")
def test_model_id_pattern_matches_what_the_hub_accepts(name):
    """The CRD pattern (and its two CEL rules, mirrored by the model's validator) accept
    exactly the ASCII ids huggingface_hub's validate_repo_id accepts, and no others."""
    ours = we_accept(name)
    if name.isascii():
        assert ours == hub_accepts(name), name
    else:
        assert not ours, name  # the hub's \w is Unicode; the Hub itself is not
    # pydantic's regex engine and Python's agree on the pattern.
    assert ours == (re.fullmatch(MODEL_ID_PATTERN, name) is not None and len(name) <= 193
                    and all(len(p) <= 96 for p in name.split("/"))
                    and not name.endswith(".git"))


def _mutations() -> st.SearchStrategy[str]:
    """Protected flags as people and attackers write them, and near misses."""
    flag = st.sampled_from(sorted(PROTECTED_FLAGS))
    short = st.sampled_from(sorted(PROTECTED_SHORT_FLAGS))

    def spell(f: str, upper: bool, under: bool, cut: int, no: bool, tail: str) -> str:
        body = f[2:]
        if cut:
            body = body[: max(1, len(body) - cut)]
        if under:
            body = body.replace("-", "_")
        if upper:
            body = body.upper()
        return ("--no-" if no else "--") + body + tail

    longs = st.builds(spell, flag, st.booleans(), st.booleans(), st.integers(0, 30),
                      st.booleans(), st.sampled_from(["", "=8", ".x=1", "=", "x"]))
    shorts = st.builds(lambda s, t: s + t, short, st.sampled_from(["", "=8", "8", "x"]))
    other = st.text(alphabet="-_=.abcdeklmnoprstuvxyz0189", max_size=16)
    return st.one_of(longs, shorts, other, st.sampled_from(["--max-num-seqs", "-O3", "-1"]))


@settings(max_examples=800, deadline=None)
@given(_mutations())
def test_extra_args_guard_is_the_launchers_own_refusal(token):
    refused = refused_flag(token) is not None
    # what vLLM's own parser refuses (tests/unit/engine/test_vllm_cli.py)
    by_vllm = refusal([token])
    try:
        EngineSpec(extra_args=[token])
    except ValidationError as exc:
        assert refused or by_vllm, token
        assert "is refused" in str(exc) if refused else one_line(by_vllm) in str(exc)
    else:
        assert not refused and by_vllm is None, token


@pytest.mark.parametrize("name", ["SPILLWAY_PLAN", "SPILLWAY_ANYTHING", *RESERVED_ENV_NAMES])
def test_reserved_env_names_are_refused(name):
    with pytest.raises(ValidationError, match="refused"):
        EngineSpec(env=[{"name": name, "value": "x"}])
    EngineSpec(env=[{"name": "MY_" + name, "value": "x"}])


@pytest.mark.parametrize("name", sorted(PLAN_ENV_OWNERS))
def test_env_the_plan_depends_on_is_refused_naming_its_field(name):
    """VLLM_PP_LAYER_PARTITION and kin change what vLLM serves against the plan (another
    layer split, other ranks): refused with the field the plan follows, by the model
    and by the CRD's rule (the same words)."""
    field = PLAN_ENV_OWNERS[name][1]
    with pytest.raises(ValidationError, match=re.escape(f"the plan follows from spec.{field}")):
        EngineSpec(env=[{"name": name, "value": "4,4"}])
    rule = CEL_RULES["spec.engine.env[]"][0]
    assert f"'{name}'" in rule["rule"] and field in rule["messageExpression"]


def test_a_planner_crash_is_refused_as_an_invalid_config(monkeypatch, caplog):
    def boom(config, request):
        raise TypeError("'int' object is not subscriptable")

    monkeypatch.setattr(reconciler, "make_plan", boom)
    spec = InferenceDeploymentSpec(model={"name": "a/b"})
    with pytest.raises(reconciler.PlanCrashed) as info:
        reconciler.make_plan_safely({}, spec)
    reason, message, outcome = reconciler.plan_failure(info.value)
    assert (reason, outcome) == ("ModelConfigInvalid", "refused")
    assert "TypeError" in message and "\n" not in message


def test_pipeline_stages_sharing_a_node_are_refused_with_the_field(monkeypatch):
    """Stages are served one per node (each node maps its stage's offload region): a
    spec that would put two stages in one pod is refused before planning, no pods."""
    monkeypatch.setattr(reconciler, "make_plan", lambda *a: pytest.fail("planned"))
    spec = InferenceDeploymentSpec(model={"name": "a/b"},
                                   engine={"pipelineParallelSize": 2})  # fmt: skip
    with pytest.raises(reconciler.PlanRefused) as info:
        reconciler.make_plan_safely({}, spec)
    _, message, outcome = reconciler.plan_failure(info.value)
    assert outcome == "refused" and "spec.engine.nodes" in message
    assert "pipelineParallelSize (2)" in message


def test_a_body_no_apply_could_take_is_never_posted():
    """Duplicate keys in a list server-side apply keys by item: a POST would take it,
    every later apply would not, so the child goes by apply and is refused whole."""
    from spillway_operator.plumbing.kube import duplicate_list_keys

    env = [{"name": "FOO", "value": "a"}, {"name": "FOO", "value": "b"}]
    deployment = {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "env": env, "ports": [{"containerPort": 8000}]}]}}}}
    assert duplicate_list_keys(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0]["env"] = env[:1]
    assert not duplicate_list_keys(deployment)
    two_ports = [{"containerPort": 8000}, {"containerPort": 8000, "protocol": "UDP"}]
    assert not duplicate_list_keys({"ports": two_ports})
    assert duplicate_list_keys({"ports": [{"containerPort": 8000}, {"containerPort": 8000}]})
    assert not duplicate_list_keys({"args": ["--a", "--a"]})  # an atomic list
