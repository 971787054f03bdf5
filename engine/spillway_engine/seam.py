"""The seam between the operator and the engine pod: what both sides must agree on.

The operator writes, and the pod reads, two files in the plan ConfigMap (and points
the pod's probes at the paths the engine serves): the plan
(``plan.json``, :class:`spillway_engine.planner.plan.Plan`, the planner's one typed
model) and the serving options beside it (``engine.json``, :class:`EngineOptions`). The
operator admits, and the launcher accepts, the same ``extraArgs``: none that sets a flag
only the plan or the launcher may set (:data:`PROTECTED_FLAGS`), none that vLLM's own
parser would refuse (:mod:`spillway_engine.vllm_cli`). Both sides import this module;
it imports nothing above the planner.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_engine import vllm_cli
from spillway_engine.planner.plan import Plan

__all__ = [
    "DISK_TIER_MOUNT",
    "DIST_PORT",
    "DRAIN_PATH",
    "ENGINE_OPTIONS_FILE",
    "ENGINE_PORT",
    "KV_EVENTS_PORT",
    "PLAN_FILE",
    "PROTECTED_FLAGS",
    "PROTECTED_SHORT_FLAGS",
    "READY_PATH",
    "EngineOptions",
    "EngineOptionsError",
    "Plan",
    "event_port_name",
    "extra_args_refusal",
    "parse_engine_options",
    "refused_flag",
]

#: The plan ConfigMap's keys, and the files the pod mounts.
PLAN_FILE = "plan.json"
ENGINE_OPTIONS_FILE = "engine.json"
#: What the engine serves on its port beside vLLM's API (spillway_engine.launcher.drain)
#: and the operator's pod spec points at: readiness (not ready once a drain starts),
#: and the preStop drain.
READY_PATH = "/spillway/ready"
#: Where the pod mounts the disk tier's volume (plan.disk); the tier keeps its files
#: under <mount>/<plan.disk.cache_key>, so another plan's files are never read.
DISK_TIER_MOUNT = "/var/cache/spillway/kv"
DRAIN_PATH = "/spillway/drain"
#: A replica over several pods (``spillway-engine serve --nnodes N``): torch.distributed's
#: rendezvous (vLLM's ``--master-port``) and the data-parallel RPC port on the leader
#: pod, which the operator exposes as a container port (spillway_engine.launcher.multinode).
DIST_PORT = 29500
#: The engine's serving port (vLLM's API, its /metrics and the paths above).
ENGINE_PORT = 8000
#: The base port of the engine's KV-event publishers (vLLM's default): data-parallel rank
#: r publishes on this + r, ports the operator declares on the pod
#: (spillway_engine.launcher.kv_events).
KV_EVENTS_PORT = 5557


def event_port_name(rank: int) -> str:
    """The container port name of data-parallel rank ``rank``'s KV-event publisher:
    kv-events, kv-events-1, ... (routers find the ports by these names)."""
    return "kv-events" if rank == 0 else f"kv-events-{rank}"


class EngineOptionsError(ValueError):
    """``engine.json`` is not what the operator writes; the message names the key."""


# ------------------------------------------------------------------ engine options



@dataclass(frozen=True)
class EngineOptions:
    """``engine.json``: serving options the operator writes beside the plan."""

    model: str | None = None
    revision: str | None = None
    served_model_name: str | None = None
    weights_path: str | None = None
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    eviction_policy: str | None = None
    offload_enabled: bool = True
    kv_events: bool = True
    kv_events_port: int = KV_EVENTS_PORT
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        """The file the operator writes (keys sorted: the same options, the same text)."""
        data = dataclasses.asdict(self)
        data["extra_args"] = list(self.extra_args)
        return json.dumps(data, indent=2, sort_keys=True)


def _opt(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str | Path) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise EngineOptionsError(f"engine options {path}: {key} must be {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise EngineOptionsError(f"engine options {path}: {key} must be {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", bool: "true or false", float: "a number", int: "a number"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return names.get(kinds[0], kinds[0].__name__)


def parse_engine_options(data: Any, path: str | Path) -> EngineOptions:
    """The options from ``engine.json``'s parsed JSON; ``path`` names it in errors."""
    if not isinstance(data, Mapping):
        raise EngineOptionsError(f"engine options {path} is not a JSON object")
    extra = data.get("extra_args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise EngineOptionsError(f"engine options {path}: extra_args must be a list of strings")
    util = _opt(data, "gpu_memory_utilization", (int, float), path)
    if util is not None and not 0 < util <= 1:
        raise EngineOptionsError(
            f"engine options {path}: gpu_memory_utilization must be in (0, 1], got {util}"
        )
    enabled = _opt(data, "offload_enabled", bool, path)
    kv_events = _opt(data, "kv_events", bool, path)
    events_port = _opt(data, "kv_events_port", int, path)
    if events_port is not None and not 1 <= events_port <= 65535:
        raise EngineOptionsError(
            f"engine options {path}: kv_events_port must be a port (1-65535), got {events_port}"
        )
    options = EngineOptions(
        model=_opt(data, "model", str, path),
        revision=_opt(data, "revision", str, path),
        served_model_name=_opt(data, "served_model_name", str, path),
        weights_path=_opt(data, "weights_path", str, path),
        gpu_memory_utilization=None if util is None else float(util),
        dtype=_opt(data, "dtype", str, path),
        eviction_policy=_opt(data, "eviction_policy", str, path),
        offload_enabled=True if enabled is None else enabled,
        kv_events=True if kv_events is None else kv_events,
        kv_events_port=KV_EVENTS_PORT if events_port is None else events_port,
        extra_args=tuple(extra),
    )
    if not (options.model or options.weights_path):
        raise EngineOptionsError(f"engine options {path}: give model or weights_path")
    return options


# ------------------------------------------------------------ refused extra args

_PARALLEL = "the plan's parallelism (re-plan with another size)"
_GEOMETRY = "the planned KV geometry (re-plan instead)"
_OFFLOAD = "the plan's offload connector config (set offload options in the spec)"
_LAUNCHER = "spillway-engine serve (set it in engine.json / the spec)"

#: Long flags (dashes, no ``--no-`` prefix) that only the plan or the launcher may set.
PROTECTED_FLAGS: dict[str, str] = {
    "--tensor-parallel-size": _PARALLEL,
    "--pipeline-parallel-size": _PARALLEL,
    "--data-parallel-size": _PARALLEL,
    "--data-parallel-size-local": _PARALLEL,
    "--decode-context-parallel-size": _PARALLEL,
    "--prefill-context-parallel-size": _PARALLEL,
    "--dcp-kv-cache-interleave-size": _PARALLEL,
    "--cp-kv-cache-interleave-size": _PARALLEL,
    "--distributed-executor-backend": _PARALLEL,
    "--nnodes": _PARALLEL,
    "--node-rank": _PARALLEL,
    "--master-addr": _PARALLEL,
    "--master-port": _PARALLEL,
    "--data-parallel-address": _PARALLEL,
    "--data-parallel-rpc-port": _PARALLEL,
    "--data-parallel-start-rank": _PARALLEL,
    "--max-model-len": _GEOMETRY,
    "--kv-cache-dtype": _GEOMETRY,
    "--kv-cache-dtype-skip-layers": _GEOMETRY,
    "--block-size": _GEOMETRY,
    "--enable-prefix-caching": _GEOMETRY,
    "--disable-prefix-caching": _GEOMETRY,
    "--prefix-match-unit": _GEOMETRY,
    "--prefix-cache-retention-interval": _GEOMETRY,
    "--enable-hybrid-kv-cache-manager": _GEOMETRY,
    "--disable-hybrid-kv-cache-manager": _GEOMETRY,
    "--mamba-cache-dtype": _GEOMETRY,
    "--mamba-ssm-cache-dtype": _GEOMETRY,
    "--mamba-cache-mode": _GEOMETRY,
    "--mamba-block-size": _GEOMETRY,
    "--attention-backend": _GEOMETRY,
    "--speculative-config": _GEOMETRY,
    "--spec-model": _GEOMETRY,
    "--hf-overrides": _GEOMETRY,
    "--hf-config-path": _GEOMETRY,
    "--config": "every flag at once (a config file could set plan-owned flags)",
    "--kv-transfer-config": _OFFLOAD,
    "--kv-offloading-size": _OFFLOAD,
    "--kv-offloading-backend": _OFFLOAD,
    "--model": _LAUNCHER,
    "--revision": _LAUNCHER,
    "--served-model-name": _LAUNCHER,
    "--gpu-memory-utilization": _LAUNCHER,
    "--dtype": _LAUNCHER,
    "--host": _LAUNCHER,
    "--port": _LAUNCHER,
    "--uds": _LAUNCHER,
    "--headless": _LAUNCHER,
}

#: vLLM's short aliases of protected flags.
PROTECTED_SHORT_FLAGS: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpr": "--data-parallel-start-rank",
}


def canonical_flag(token: str) -> str:
    """``--Foo_bar.key=1`` -> ``--foo-bar``; ``--no-enable-x`` -> ``--enable-x``."""
    name = token.split("=", 1)[0]
    name = "--" + name[2:].replace("_", "-").lower()
    name = name.split(".", 1)[0]  # vLLM's dotted JSON args: --kv-transfer-config.x
    if name.startswith("--no-"):
        name = "--" + name[5:]
    return name


def refused_flag(token: str) -> tuple[str, str] | None:
    """``(flag, owner)`` when ``token`` sets a flag the plan or launcher owns."""
    if token.startswith("--") and len(token) > 2:
        name = canonical_flag(token)
        if name in PROTECTED_FLAGS:
            return name, PROTECTED_FLAGS[name]
        # argparse accepts unambiguous prefixes (--max-model -> --max-model-len)
        if len(name) >= 4:
            for flag, owner in PROTECTED_FLAGS.items():
                if flag.startswith(name):
                    return flag, owner
        return None
    if token.startswith("-") and len(token) > 1 and not _is_number(token):
        short = token.split("=", 1)[0]
        for alias in sorted(PROTECTED_SHORT_FLAGS, key=len, reverse=True):
            if short.startswith(alias):
                flag = PROTECTED_SHORT_FLAGS[alias]
                return f"{alias} ({flag})", PROTECTED_FLAGS[flag]
    return None


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def extra_args_refusal(extra_args: Sequence[str]) -> str | None:
    """Why ``extra_args`` cannot be passed to ``vllm serve``, in one line, or None:
    a plan-owned flag first (its own message), then what vLLM's parser would refuse
    where the launcher puts them (vLLM's own message)."""
    for token in extra_args:
        hit = refused_flag(token)
        if hit is not None:
            flag, owner = hit
            return f"extra argument {token!r} is refused: {flag} is set by {owner}"
    refused = vllm_cli.refusal(extra_args)
    if refused is not None:
        version = vllm_cli.load_table()["vllm_version"]
        return (f"extra arguments {shlex.join(extra_args)} are refused: vllm serve {version} "
                f"would not start with them: {vllm_cli.one_line(refused)}")
    return None
