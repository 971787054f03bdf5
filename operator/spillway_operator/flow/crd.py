"""Generate the InferenceDeployment CRD from the typed model in ``spec``.

``python -m spillway_operator.flow.crd > crds/inferencedeployments.spillway.dev.yaml``;
a unit test fails when the committed file differs from what this prints, so the
schema, defaults and validation rules cannot drift from the model.

Pydantic emits JSON Schema (2020-12, with $defs); Kubernetes wants a structural
OpenAPI v3.0 schema: references inlined, no null branches, no
``additionalProperties: false`` beside ``properties``, boolean exclusive bounds.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from spillway_operator.flow import spec as api
from spillway_operator.flow.cel import CEL_RULES
from spillway_operator.flow.status_model import InferenceDeploymentStatus

CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
_DROP = {"title", "discriminator", "$defs"}


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    # Inline references (pydantic puts nested models in $defs).
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}
    # Optional[X] is anyOf [X, null]: absent means unset, so keep X alone.
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {branches}")
        node = {**branches[0], **node}
        return _structural(node, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
        return _structural(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, bool):
            continue  # pruning drops unknown fields; Strict field validation reports them
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "default":
            if value is not None:
                out[key] = _without_nulls(value)
        else:
            out[key] = value
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("properties", None)
    if "properties" in out:
        out.setdefault("type", "object")
        # Nested objects whose fields all have defaults default to {}, so the API
        # server fills their defaults too and `kubectl get -o yaml` shows them --
        # except those whose absence means something (default None, e.g. emulateGPU:
        # present turns the emulated GPU on).
        for name, prop in out["properties"].items():
            absent_means_off = "default" in node.get("properties", {}).get(name, {}) and (
                node["properties"][name]["default"] is None)
            if (prop.get("type") == "object" and "properties" in prop
                    and not prop.get("required") and not absent_means_off):
                prop.setdefault("default", {})
    return out


def _schema_of(model: type[api._Model]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def _attach_rules(spec_schema: dict[str, Any]) -> None:
    for path, rules in CEL_RULES.items():
        node = {"properties": {"spec": spec_schema}}
        for part in path.split("."):
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):  # the rule reads each item of the list
                node = node["items"]
        node["x-kubernetes-validations"] = rules


def spec_schema() -> dict[str, Any]:
    schema = _schema_of(api.InferenceDeploymentSpec)
    _attach_rules(schema)
    return schema


def _strip_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_strip_defaults(v) for v in node]
    return node


def status_schema() -> dict[str, Any]:
    # Status is written only by the operator: no server-side defaults there.
    return _strip_defaults(_schema_of(InferenceDeploymentStatus))


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Host Pool", "type": "string", "jsonPath": ".status.plan.hostPool"},
    {"name": "Capacity", "type": "integer", "jsonPath": ".status.plan.capacityTokens",
     "description": "tokens the host pool holds per engine"},
    {"name": "Pressure", "type": "number", "jsonPath": ".status.autoscaling.pressure"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _version() -> dict[str, Any]:
    return {
        "name": api.VERSION,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": "A vLLM inference deployment with a planned KV-cache host "
                "offload tier, scaled on offload pressure.",
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": spec_schema(),
                    "status": status_schema(),
                },
            }
        },
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": PRINTER_COLUMNS,
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "spillway"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.KIND.lower(),
                "shortNames": [api.SHORT_NAME],
                "categories": ["spillway"],
            },
            "versions": [_version()],
        },
    }


HEADER = (
    "# Generated by `python -m spillway_operator.flow.crd` from\n"
    "# operator/spillway_operator/flow/spec.py.\n"
    "# Do not edit by hand: change the model and regenerate (a unit test compares them).\n"
)


def render() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
