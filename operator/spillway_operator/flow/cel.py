"""The CRD's CEL validation rules (x-kubernetes-validations), generated from the same
names and bounds the pydantic model checks (``flow.spec_input``), so the API server
refuses at apply what the operator would refuse on parse, with the same message.

``CEL_RULES`` maps a path in the spec ("a.b[]": each item of the list a.b) to its
rules; ``flow.crd`` attaches them to the schema.
"""

from __future__ import annotations

from typing import Any

from spillway_engine import vllm_cli
from spillway_engine.seam import DIST_PORT, ENGINE_PORT, PROTECTED_FLAGS, PROTECTED_SHORT_FLAGS
from spillway_operator.flow.imageref import CEL_CHECKS as IMAGE_CEL_CHECKS
from spillway_operator.flow.spec_input import (
    DISK_CLAIM_MESSAGE,
    DISK_CLASS_MESSAGE,
    EVENT_PORTS_MESSAGE,
    MAX_CPU,
    MAX_MEMORY,
    MODEL_ID_PART_MAX,
    PLAN_ENV_OWNERS,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
)


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry; messages say which field and why."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _quantity_bound_rule(field: str, maximum: str) -> dict[str, str]:
    """CEL: an optional quantity field (or auto) is at most maximum."""
    return cel(
        f"!has(self.{field}) || self.{field} == 'auto' || "
        f"quantity(self.{field}).compareTo(quantity('{maximum}')) <= 0",
        f"{field} must be at most {maximum}: no node has more",
        f".{field}",
    )


def _cel_strings(items: Any) -> str:
    return "[" + ", ".join("'" + i + "'" for i in items) + "]"


def _flag_prefixes() -> dict[str, bool]:
    """Every name (no dashes) the launcher refuses as a long flag: each protected flag
    and each prefix of it argparse would expand to it (2+ characters)."""
    names = [f.removeprefix("--") for f in PROTECTED_FLAGS]
    return {n[:k]: True for n in sorted(names) for k in range(2, len(n) + 1)}


def _extra_arg_rule() -> dict[str, str]:
    """The engine launcher's refusal (``refused_flag``) in CEL, built from its own
    flag lists: a long flag canonicalised as the launcher does (case, '_' for '-',
    '=value', '.key', '--no-'), exact or as an argparse prefix; or a short alias.

    The names are a map literal: a lookup costs the API server's CEL budget almost
    nothing, where a regex or a list scan over 4 KiB arguments exceeds it."""
    prefixes = "{" + ", ".join(f"'{k}': true" for k in _flag_prefixes()) + "}"
    flag = "('--' + self.split('=')[0].split('.')[0].substring(2).replace('_', '-').lowerAscii())"
    name = f"({flag}.startsWith('--no-') ? {flag}.substring(5) : {flag}.substring(2))"
    long_refused = f"(self.startsWith('--') && {name} in {prefixes})"
    shorts = _cel_strings(sorted(PROTECTED_SHORT_FLAGS))
    short_refused = f"(!self.startsWith('--') && {shorts}.exists(a, self.startsWith(a)))"
    shown = "(size(self) > 80 ? self.substring(0, 80) + '...' : self)"
    return {
        "rule": f"!({long_refused} || {short_refused})",
        "messageExpression": f"'engine.extraArgs: ' + {shown} + ' is refused: it sets a flag "
        "the plan or spillway-engine serve owns (parallelism, geometry, offload, model, "
        "port); set it through the spec'",
    }


def _vllm_option_rule() -> dict[str, str]:
    """vllm serve's own refusal of a long option it does not have, per item
    (``vllm_cli.unknown_long_flag``, from the committed table of vLLM's options): the
    name before '=' and the first '.', '_' read as '-' as vLLM does, must be one of its
    option names or a prefix of one (argparse's abbreviations). Items with a space are
    positionals to argparse and left to the operator's full check, as is all context.

    The prefixes are two map literals (``vllm_cli.prefix_tables``; a literal costs the
    CEL budget a constant): those shared by several names, and each other name under
    its shortest prefix no other name has, tried at each length such a prefix has."""
    shared, unique = vllm_cli.prefix_tables()
    shared_map = "{" + ",".join(f'"{p}":1' for p in shared) + "}"
    unique_map = "{" + ",".join(f'"{k}":"{n}"' for k, n in unique.items()) + "}"
    lengths = "[" + ",".join(str(n) for n in sorted({len(k) for k in unique})) + "]"
    # [x].all(v, ...) binds v to x once (no cel.bind needed)
    key = "self.split('=')[0].split('.')[0].replace('_', '-')"
    known = (
        f"n in {shared_map} || [{unique_map}].all(u, {lengths}.exists(l, size(n) >= l && "
        "n.substring(0, l) in u && u[n.substring(0, l)].startsWith(n)))"
    )
    shown = "(size(self) > 80 ? self.substring(0, 80) + '...' : self)"
    version = vllm_cli.load_table()["vllm_version"]
    return {
        "rule": f"!self.startsWith('--') || self.contains(' ') || [{key}].all(k, size(k) <= 2 "
        f"|| [k.substring(2)].all(n, {known}))",
        "messageExpression": f"'engine.extraArgs: ' + {shown} + ' is not an option of vllm "
        f"serve {version}, which would exit 2: unrecognized arguments: ' + {shown}",
    }


def _int_value_rule() -> dict[str, str]:
    """vllm serve's refusal of a value of letters only for an int option, per item in
    its ``--name=value`` form (``vllm_cli.bad_int_value``), with argparse's message: the
    names are a map literal from the committed table, to the option as argparse names
    it. A value given as the next item needs the whole list: the operator's (SpecInvalid)."""
    names = "{" + ",".join(f'"{n}":"{shown}"' for n, shown in
                           sorted(vllm_cli.int_options().items())) + "}"
    name = "self.split('=')[0].substring(2).replace('_', '-')"
    value = "self.substring(size(self.split('=')[0]) + 1)"
    version = vllm_cli.load_table()["vllm_version"]
    return {
        "rule": f"!self.startsWith('--') || !self.contains('=') || "
        f"self.split('=')[0].contains('.') || !({name} in {names}) || "
        f"!{value}.matches('^[A-Za-z]*$')",
        "messageExpression": f"'engine.extraArgs: ' + (size(self) > 80 ? self.substring(0, 80) "
        f"+ '...' : self) + ' is refused: vllm serve {version} would exit 2: argument ' + "
        f"{names}[{name}] + ': invalid int value: \\'' + {value} + '\\''",
    }


def _env_rule() -> dict[str, str]:
    prefixes = " || ".join(f"self.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
    return {
        "rule": f"!({prefixes} || self.name in {_cel_strings(RESERVED_ENV_NAMES)})",
        "messageExpression": "'engine.env: ' + self.name + ' is refused: Spillway sets it or "
        "it changes what the engine runs'",
    }


def _env_owner_rule() -> dict[str, str]:
    """spec_input.env_owner_message in CEL: the reasons are a map literal."""
    why = "{" + ", ".join(
        f"'{name}': 'it changes {what}, which the plan follows from spec.{field}'"
        for name, (what, field) in sorted(PLAN_ENV_OWNERS.items())) + "}"
    return {
        "rule": f"!(self.name in {_cel_strings(sorted(PLAN_ENV_OWNERS))})",
        "messageExpression": f"'engine.env: ' + self.name + ' is refused: ' + {why}[self.name]",
    }


# CEL rules for what can be checked statically, attached to the object they read
# ("a.b[]": each item of the list a.b).
CEL_RULES: dict[str, list[dict[str, str]]] = {
    "spec": [
        cel(
            "!self.autoscaling.enabled || (self.replicas >= self.autoscaling.minReplicas && "
            "self.replicas <= self.autoscaling.maxReplicas)",
            "spec.replicas must lie within autoscaling.minReplicas..maxReplicas while "
            "autoscaling is enabled (the autoscaler owns it)",
            ".replicas",
        ),
        cel(
            "self.weights.source != 'pvc' || has(self.weights.pvc)",
            "weights.pvc is required when weights.source is pvc",
            ".weights",
        ),
    ],
    "spec.model": [
        cel(
            f"self.name.split('/').all(p, size(p) <= {MODEL_ID_PART_MAX})",
            f"model.name: each part of a model id is at most {MODEL_ID_PART_MAX} characters",
            ".name",
        ),
        cel("!self.name.endsWith('.git')", "model.name: a model id cannot end in .git", ".name"),
    ],
    "spec.engine": [
        cel(
            "!has(self.kvEvents) || !has(self.kvEvents.port) || "
            "(self.kvEvents.port + (has(self.dataParallelSize) ? self.dataParallelSize : 1) "
            f"- 1 <= 65535 && !(self.kvEvents.port <= {ENGINE_PORT} && {ENGINE_PORT} <= "
            "self.kvEvents.port + (has(self.dataParallelSize) ? self.dataParallelSize : 1) - 1)"
            f" && !(self.kvEvents.port <= {DIST_PORT} && {DIST_PORT} <= self.kvEvents.port + "
            "(has(self.dataParallelSize) ? self.dataParallelSize : 1) - 1))",
            EVENT_PORTS_MESSAGE,
            ".kvEvents.port",
        ),
    ],
    "spec.engine.image": [cel(rule, f"engine.image: {why}") for rule, why in IMAGE_CEL_CHECKS],
    "spec.engine.extraArgs[]": [_extra_arg_rule(), _vllm_option_rule(), _int_value_rule()],
    "spec.engine.speculative": [
        cel(
            "self.method == 'mtp' ? !has(self.model) : has(self.model)",
            "engine.speculative.model is required for draft_model and eagle3 and refused "
            "for mtp (the model's own heads)",
            ".model",
        ),
    ],
    "spec.engine.speculative.model": [
        cel(
            f"self.name.split('/').all(p, size(p) <= {MODEL_ID_PART_MAX})",
            f"engine.speculative.model.name: each part of a model id is at most "
            f"{MODEL_ID_PART_MAX} characters",
            ".name",
        ),
        cel(
            "!self.name.endsWith('.git')",
            "engine.speculative.model.name: a model id cannot end in .git",
            ".name",
        ),
    ],
    "spec.engine.env[]": [_env_owner_rule(), _env_rule()],
    "spec.autoscaling": [
        cel(
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            ".minReplicas",
        ),
    ],
    "spec.resources": [
        _quantity_bound_rule("cpu", MAX_CPU),
        _quantity_bound_rule("extraMemory", MAX_MEMORY),
        cel(
            "!has(self.gpuPools) || self.gpuPools.all(p, "
            "self.gpuPools.exists_one(q, q.name == p.name))",
            "resources.gpuPools: each pool needs a name of its own (its workload's suffix)",
            ".gpuPools",
        ),
    ],
    "spec.resources.gpuPools[]": [
        cel(
            "self.minReplicas <= self.maxReplicas",
            "resources.gpuPools[].minReplicas must not exceed maxReplicas",
            ".minReplicas",
        ),
    ],
    "spec.offload": [
        _quantity_bound_rule("hostMemory", MAX_MEMORY),
        _quantity_bound_rule("memoryLimit", MAX_MEMORY),
        cel(
            "!(has(self.blocksPerChunk) && has(self.chunkTokens))",
            "set only one of offload.blocksPerChunk and offload.chunkTokens",
            ".chunkTokens",
        ),
        cel(
            "self.hostMemory == 'auto' || quantity(self.hostMemory).isGreaterThan(quantity('0'))",
            "offload.hostMemory must be auto or a positive quantity",
            ".hostMemory",
        ),
        cel(
            "!has(self.disk) || self.offloader == 'spillway'",
            "offload.disk runs under offloader spillway only",
            ".disk",
        ),
    ],
    "spec.offload.disk": [
        _quantity_bound_rule("size", MAX_MEMORY),
        cel(
            "quantity(self.size).isGreaterThan(quantity('0'))",
            "offload.disk.size must be a positive quantity",
            ".size",
        ),
        cel(
            "(self.volume == 'SharedPVC') == has(self.claimName)",
            DISK_CLAIM_MESSAGE,
            ".claimName",
        ),
        cel(
            "!has(self.storageClassName) || self.volume == 'Ephemeral'",
            DISK_CLASS_MESSAGE,
            ".storageClassName",
        ),
    ],
}
