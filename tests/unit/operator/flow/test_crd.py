"""The CRD is generated from the typed spec model and stays in sync with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from spillway_operator.flow import crd
from spillway_operator.flow.spec import InferenceDeploymentSpec

ROOT = Path(__file__).resolve().parents[4]
CRD_FILE = ROOT / "crds" / "inferencedeployments.spillway.dev.yaml"


def walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def test_committed_crd_is_generated_from_the_model():
    assert CRD_FILE.read_text() == crd.render(), (
        "crds/ is stale: run `python -m spillway_operator.flow.crd > "
        + str(CRD_FILE.relative_to(ROOT)) + "`"
    )


def test_schema_is_structural():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        if not isinstance(node, dict):
            continue
        for banned in ("$ref", "$defs", "anyOf", "allOf", "title"):
            assert banned not in node, f"{banned} at {path}"
        if "properties" in node:
            assert node.get("type") == "object", path
            assert not isinstance(node.get("additionalProperties"), bool), path
        if "default" in node:
            assert node["default"] is not None, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_schema_defaults_match_the_model_defaults():
    """What the API server fills in equals what the operator assumes when parsing."""
    spec_schema = crd.spec_schema()
    model_default = InferenceDeploymentSpec(model={"name": "x/y"}).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    for section in ("engine", "offload", "autoscaling", "resources", "weights"):
        props = spec_schema["properties"][section]["properties"]
        for field, value in model_default[section].items():
            assert props[field].get("default") == value, f"{section}.{field}"


def test_scale_subresource_and_printer_columns():
    version = crd.build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Model", "Desired", "Ready", "Host Pool", "Capacity", "Pressure", "Age"]
    meta = yaml.safe_load(CRD_FILE.read_text())["spec"]["names"]
    assert meta["shortNames"] == ["infdep"] and meta["categories"] == ["spillway"]


def test_model_refuses_what_the_schema_refuses():
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate({"model": {"name": "a/b"}, "replicas": -1})
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate(
            {"model": {"name": "a/b"}, "engine": {"tensorParallelSize": 0}}
        )
    with pytest.raises(ValidationError):
        InferenceDeploymentSpec.model_validate({"model": {"name": "a/b"}, "bogus": 1})
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"name": "a/b"}, "engine": {"tensorParallelSize": 4, "dataParallelSize": 2}}
    )
    assert spec.gpus_per_pod == 8


@pytest.mark.parametrize(("section", "field", "value", "refused"), [
    ("offload", "hostMemory", "99999999999999999999Ei", True),
    ("offload", "hostMemory", "1Pi", False),
    ("offload", "hostMemory", "1125899906842625", True),  # 1Pi + 1 byte
    ("offload", "memoryLimit", "1.2P", True),
    ("offload", "memoryLimit", "512Ti", False),
    ("resources", "extraMemory", "2Pi", True),
    ("resources", "cpu", "65536", False),
    ("resources", "cpu", "65536001m", True),
    ("resources", "cpu", "1M", True),
])
def test_quantities_beyond_any_node_are_refused_by_field(section, field, value, refused):
    """The model's bound matches the CEL rule the API server applies (its message names the
    same bound); both keep absurd sizes from being planned into pods no API server stores."""
    body = {"model": {"name": "a/b"}, section: {field: value}}
    if not refused:
        InferenceDeploymentSpec.model_validate(body)
        return
    with pytest.raises(ValidationError, match=f"{section}.{field}"):
        InferenceDeploymentSpec.model_validate(body)
    rules = crd.render()
    assert f"{field} must be at most" in rules


def test_objects_whose_presence_turns_something_on_have_no_default():
    """``engine.emulateGPU: {}`` turns the emulated GPU on: the API server must not
    default it in, or every InferenceDeployment would request no GPU."""
    engine = crd.spec_schema()["properties"]["engine"]
    assert "default" not in engine["properties"]["emulateGPU"]
    assert engine["properties"]["emulateGPU"]["properties"]["speed"]["default"] == 1.0
    assert "emulateGPU" not in engine["default"]  # nor through the engine's own default
    assert crd.spec_schema()["properties"]["offload"]["default"]["enabled"] is True


def test_speculative_names_a_drafter_exactly_when_it_is_separate():
    base = {"model": {"name": "Qwen/Qwen3-8B"}}
    drafter = {"name": "Qwen/Qwen3-0.6B"}
    for method, model in (("draft_model", None), ("eagle3", None), ("mtp", drafter)):
        speculative = {"method": method, "numSpeculativeTokens": 2}
        if model is not None:
            speculative["model"] = model
        with pytest.raises(ValidationError, match="speculative method"):
            InferenceDeploymentSpec.model_validate({**base, "engine": {"speculative": speculative}})
    spec = InferenceDeploymentSpec.model_validate(
        {**base, "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 4,
                                            "model": drafter}}}
    )
    assert spec.engine.speculative.model.name == "Qwen/Qwen3-0.6B"
    with pytest.raises(ValidationError):  # at least one draft token
        InferenceDeploymentSpec.model_validate(
            {**base, "engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 0}}}
        )
    # the API server applies the same rule (CEL) before the operator sees the object
    schema = crd.spec_schema()["properties"]["engine"]["properties"]["speculative"]
    [rule] = schema["x-kubernetes-validations"]
    assert rule["rule"] == "self.method == 'mtp' ? !has(self.model) : has(self.model)"
    assert "speculative" not in crd.spec_schema()["properties"]["engine"]["default"]


def test_kv_event_ports_are_checked_by_the_api_server_as_by_the_model():
    """engine.kvEvents.port: the schema's bounds and default, and a CEL rule on the
    engine with the model's message (the ranks' ports past 65535 or over the serving or
    rendezvous port)."""
    engine = crd.spec_schema()["properties"]["engine"]
    port = engine["properties"]["kvEvents"]["properties"]["port"]
    assert (port["minimum"], port["maximum"], port["default"]) == (1024, 65535, 5557)
    [rule] = [r for r in engine["x-kubernetes-validations"] if "kvEvents" in r["rule"]]
    assert rule["fieldPath"] == ".kvEvents.port"
    with pytest.raises(ValidationError) as refused:
        InferenceDeploymentSpec.model_validate(
            {"model": {"name": "a/b"}, "engine": {"kvEvents": {"port": 7990},
                                                  "dataParallelSize": 16}})
    assert rule["message"] in str(refused.value)
