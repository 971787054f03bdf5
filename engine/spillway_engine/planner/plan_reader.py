"""Reading a plan: every reader of a plan's JSON goes through :func:`read_plan`, which
names a plan of another release as such and a malformed one by its field, in one line.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from spillway_engine import __version__
from spillway_engine.planner.plan_schema import Plan
from spillway_engine.vllm_pins import VLLM_VERSION


class PlanReadError(ValueError):
    """A plan this engine cannot use; the message is one line naming the problem."""


class _Stamp(BaseModel):
    """Only the two versions, read before the whole plan so that a plan of another
    release is named as such rather than by the first field it spells differently."""

    model_config = ConfigDict(extra="ignore")

    vllm_version: str | None = None
    spillway_version: str | None = None


def read_plan(text: str | bytes, source: str) -> Plan:
    """The plan in ``text`` (JSON, as ``spillway plan --format json`` writes it).

    Every reader of a plan goes through here. Raises :class:`PlanReadError`, one line
    naming ``source``: a plan made by another Spillway or for another vLLM names both
    releases; malformed JSON or a plan that does not fit :class:`Plan` names the field.
    """
    try:
        plan = Plan.model_validate_json(text)
    except ValidationError as e:
        stamp = _stamp(text)
        if stamp is not None and _other_release(stamp):
            raise PlanReadError(_release_message(stamp, source)) from None
        raise PlanReadError(_validation_message(e, source)) from None
    if _other_release(plan):
        raise PlanReadError(_release_message(plan, source))
    return plan


def _stamp(text: str | bytes) -> _Stamp | None:
    try:
        return _Stamp.model_validate_json(text)
    except ValidationError:
        return None


def _other_release(stamp: _Stamp | Plan) -> bool:
    """Both versions must be this install's; a missing one is left to validation."""
    return any(
        found is not None and found != ours
        for found, ours in (
            (stamp.vllm_version, VLLM_VERSION),
            (stamp.spillway_version, __version__),
        )
    )


def _release_message(stamp: _Stamp | Plan, source: str) -> str:
    return (
        f"plan {source} was made by Spillway {stamp.spillway_version or '(unknown)'} for "
        f"vLLM {stamp.vllm_version or '(unknown)'}; this engine is Spillway {__version__} "
        f"with vLLM {VLLM_VERSION} (re-plan with this release)"
    )


def _field_name(loc: tuple[int | str, ...]) -> str:
    """``('kv_groups', 0, 'kind')`` -> ``kv_groups[0].kind``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _validation_message(error: ValidationError, source: str) -> str:
    errors = error.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"plan {source} is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}"
    if not first["loc"]:
        return f"plan {source} is not a JSON object"
    if all(e["type"] == "missing" for e in errors):
        missing = ", ".join(_field_name(e["loc"]) for e in errors)
        return f"plan {source} is missing {missing} (make it with `spillway plan --format json`)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = " ".join(str(first["msg"]).split())  # one line whatever pydantic says
    return f"plan {source}: {_field_name(first['loc'])}: {message}{more}"
