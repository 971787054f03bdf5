"""``spillway-engine serve``: the planned vLLM launch, run inside the GPU pod (the
command line itself is :mod:`spillway_engine.cli`).

``spillway-engine serve --plan /etc/spillway/plan/plan.json [--port 8000]`` reads the
plan and the serving options beside it (``engine.json``), builds the exact vLLM
0.33.0 ``vllm serve`` command the plan was made for, refuses extra arguments that
would change the planned geometry, and execs vLLM with ``SPILLWAY_PLAN`` set so the
Spillway plugin (:mod:`spillway_engine.launcher.plugin`) checks vLLM's real KV-cache
config against the plan at start-up and publishes the plan metrics. ``--dry-run``
prints the command instead.

A stand-in for the GPU (``--emulate-gpu``, :mod:`spillway_engine.emulator.launch`) adds
to the launch through an :class:`Overlay`, which the command line hands in: the
launcher never imports the emulator, and nothing of the plan's launch is changed.

Before vLLM starts, ``serve`` frees what an earlier engine of this pod left in the shm
folder (``--shm-dir``, ``SPILLWAY_SHM_DIR``, default /dev/shm; see
:mod:`spillway_engine.launcher.shm_cleanup`), naming each file and its bytes, then
checks that the container can hold the plan (:mod:`spillway_engine.launcher.preflight`:
shm room and the memory cgroup's limit under ``--cgroup-root`` / ``SPILLWAY_CGROUP_ROOT``
stop the start; a memlock limit below the pinned region is a warning).

KV events: unless ``engine.json`` says ``"kv_events": false`` (or the plan turns prefix
caching off), the launcher turns on vLLM's ZMQ KV-cache events with the block-hash
algorithm fixed to ``sha256`` (whose seed is vLLM's constant ``vllm-none-hash`` unless
PYTHONHASHSEED is set), so routers can hash prompts as the engine does. Each
data-parallel rank publishes on the pod's IP at a declared port (``engine.json``'s
``kv_events_port`` + rank; ``--kv-events-port`` overrides the base for engines that
share one address) under llm-d's topic ``kv@<pod-ip>:<port>@<model>``; a port already
taken stops the start (:mod:`spillway_engine.launcher.kv_events`).

Problems raise :class:`EngineCliError` (exit status 2) or :class:`PreflightShortfall`
(3); the command line (:mod:`spillway_engine.cli`) turns them into one line and the
container's termination message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_engine.launcher import drain, headless, kv_events, multinode, preflight
from spillway_engine.launcher.kv_events import events_bind_ip, kv_events_args
from spillway_engine.launcher.plugin import (
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    ENTRY_POINT_VALUE,
    ENV_PLAN,
)
from spillway_engine.launcher.shm_cleanup import free_leftovers, shm_dir
from spillway_engine.planner.plan import Plan, PlanReadError, read_plan
from spillway_engine.seam import (
    DISK_TIER_MOUNT,
    ENGINE_OPTIONS_FILE,
    EngineOptions,
    EngineOptionsError,
    extra_args_refusal,
    parse_engine_options,
)
from spillway_engine.vllm_pins import UPSTREAM_CONNECTOR, VLLM_VERSION

PROG = "spillway-engine"
EXIT_USAGE = 2
EXIT_PREFLIGHT = 3
ENV_ENGINE_OPTIONS = "SPILLWAY_ENGINE_OPTIONS"

class EngineCliError(Exception):
    """One line for stderr; exit status 2."""

    exit_code = EXIT_USAGE


class PreflightShortfall(EngineCliError):
    """The container cannot hold the plan; exit status 3."""

    exit_code = EXIT_PREFLIGHT


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise EngineCliError(message)


# ------------------------------------------------------------------------ the plan


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise EngineCliError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise EngineCliError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _read_json(path: Path, what: str) -> Any:
    text = _read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineCliError(f"{what} {path} is not valid JSON: {e}") from None


def load_plan(path: str | Path) -> Plan:
    """The plan file, read by the planner's own reader (this release's plans only)."""
    path = Path(path)
    try:
        plan = read_plan(_read_text(path, "plan"), str(path))
    except PlanReadError as e:
        raise EngineCliError(str(e)) from None
    if not plan.kv_groups:
        raise EngineCliError(f"plan {path} has no kv_groups")
    return plan


# ------------------------------------------------------------------ engine options


def load_engine_options(path: str | Path) -> EngineOptions:
    path = Path(path)
    try:
        return parse_engine_options(_read_json(path, "engine options"), path)
    except EngineOptionsError as e:
        raise EngineCliError(str(e)) from None


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse what the operator's admission refuses (:func:`seam.extra_args_refusal`):
    plan-owned flags, then what vLLM's own parser would refuse at the end of the command
    (unknown flags, a flag without its value, stray positionals... with vLLM's message)."""
    refused = extra_args_refusal(extra_args)
    if refused is not None:
        raise EngineCliError(refused)


# ------------------------------------------------------------------ the command

#: ``AttentionBackend.get_preferred_block_size`` of the backends the planner picks:
#: 16 unless the kernel takes one fixed size (spillway_engine.planner.gpus).
_FIXED_BLOCK_BACKENDS = {"FLASHMLA": 64}


def forced_block_size(plan: Plan) -> int | None:
    """The ``--block-size`` to pass, or None when vLLM picks the plan's size itself.

    The plan records the block size after alignment, not whether it was asked for.
    Without Mamba layers vLLM's own choice is the backend's preferred size, so any
    other size was forced. Mamba hybrids raise the size themselves: none is passed,
    and the start-up check catches a difference.
    """
    if plan.mamba_cache_mode is not None:
        return None
    default = _FIXED_BLOCK_BACKENDS.get(str(plan.gpu.attention_backend), 16)
    return None if plan.block_size == default else plan.block_size


def kv_cache_dtype_flag(plan: Plan) -> str:
    """``auto`` when the KV cache is in the activation dtype, else the plan's dtype.

    ``auto`` is the input the plan resolved from; passing vLLM the same input keeps
    its backend selection (which looks at the requested KV dtype) on the planner's.
    """
    return "auto" if plan.kv_cache_dtype == plan.model.dtype else plan.kv_cache_dtype


#: The disk tier's class, as vLLM's tier factory loads it (a secondary_tiers entry).
DISK_TIER_TYPE = "SpillwayDiskTier"
DISK_TIER_MODULE = "spillway_engine.offloader.disk_tier"


#: JSON merged into the disk tier's entry: tuning the plan does not decide (vLLM's
#: back-pressure water marks for a disk slower than NVMe, thread counts).
DISK_TIER_OPTIONS_ENV = "SPILLWAY_DISK_TIER_OPTIONS"


def disk_tier_config(plan: Plan, root: str,
                     env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``secondary_tiers`` entry for the plan's disk tier under ``root``."""
    disk = plan.disk
    assert disk is not None
    config: dict[str, Any] = {
        "type": DISK_TIER_TYPE,
        "module_path": DISK_TIER_MODULE,
        "root_dir": root,
        "budget_bytes": disk.budget_bytes_per_engine,
        "plan_key": disk.cache_key,
        # vLLM's detector: a disk that fails or slows down sheds stores, never requests
        "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                         "failure_threshold": 3},
    }
    if disk.writers > 1:
        # other replicas write into the same folder: spare their writes in flight; a
        # ReadWriteMany volume is a network filesystem, so vLLM's network water marks
        config["stale_temp_s"] = 600.0
        config["locality"] = "REMOTE"
    text = (os.environ if env is None else env).get(DISK_TIER_OPTIONS_ENV)
    if text:
        try:
            tuning = json.loads(text)
        except ValueError as e:
            raise EngineCliError(f"{DISK_TIER_OPTIONS_ENV} is not JSON: {e}") from None
        fixed = {"type", "module_path", "root_dir", "budget_bytes", "plan_key"}
        if not isinstance(tuning, dict) or fixed & tuning.keys():
            raise EngineCliError(
                f"{DISK_TIER_OPTIONS_ENV} must be a JSON object without "
                f"{', '.join(sorted(fixed))} (the plan and --disk-dir set them)")
        config.update(tuning)
    return config


def transfer_config(
    plan: Plan, options: EngineOptions, disk_dir: str = DISK_TIER_MOUNT
) -> tuple[dict[str, Any] | None, list[str]]:
    """The ``--kv-transfer-config`` dict (None: offloading off) and notes for the log.

    A ``spillway`` plan is served by Spillway's connector exactly as planned
    (``plan.kv_transfer_config``: connector, module path and the plan's extra
    config); an ``upstream`` plan by vLLM's own ``OffloadingConnector``.
    """
    notes: list[str] = []
    if not options.offload_enabled:
        return None, ["offloading disabled in engine.json: no --kv-transfer-config"]
    config = json.loads(json.dumps(plan.kv_transfer_config))
    if plan.offloader != "spillway":
        config["kv_connector"] = UPSTREAM_CONNECTOR
        config.pop("kv_connector_module_path", None)
    if options.eviction_policy:
        extra = config.setdefault("kv_connector_extra_config", {})
        extra["eviction_policy"] = options.eviction_policy
    if plan.disk is not None and plan.offloader == "spillway":
        extra = config.setdefault("kv_connector_extra_config", {})
        extra["secondary_tiers"] = [disk_tier_config(plan, disk_dir)]
        notes.append(f"disk tier: {plan.disk.budget_bytes_per_engine} bytes per engine under "
                     f"{disk_dir}, {plan.disk.capacity_tokens} tokens")
    if options.kv_events and plan.enable_prefix_caching:
        # host and disk stores announced with every block hash of the chunk and its tokens
        # (vLLM's opt-in), so an indexer that keys blocks by tokens (llm-d's) sees the
        # offload tiers as the GPU's, not one hash per chunk
        extra = config.setdefault("kv_connector_extra_config", {})
        extra.setdefault("self_describing_kv_events", True)
    config.setdefault("kv_role", "kv_both")
    return config, notes


def _dtype_flag(plan: Plan, options: EngineOptions) -> str:
    planned = plan.model.dtype
    asked = options.dtype
    if asked not in (None, "", "auto") and asked != planned:
        raise EngineCliError(
            f"engine.json dtype {asked} disagrees with the plan's model dtype {planned} "
            "(the KV page sizes were planned for the latter; re-plan)"
        )
    return planned


def build_command(
    plan: Plan,
    options: EngineOptions,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    extra_args: Sequence[str] = (),
    events_ip: str | None = None,
    events_port: int | None = None,
    disk_dir: str = DISK_TIER_MOUNT,
) -> tuple[list[str], list[str]]:
    """``vllm serve ...`` for the plan, and notes for the log. Raises EngineCliError.
    ``events_ip``: the address the KV-event publisher binds (:func:`events_bind_ip`);
    ``events_port``: its base port (default: engine.json's)."""
    user_args = [*options.extra_args, *extra_args]
    check_extra_args(user_args)
    model = options.weights_path or options.model
    assert model is not None  # parse_engine_options insists
    par = plan.parallelism
    cmd = ["vllm", "serve", model]
    served = options.served_model_name or options.model
    if served:
        cmd += ["--served-model-name", served]
    if options.revision and not options.weights_path:
        cmd += ["--revision", options.revision]
    cmd += [
        "--tensor-parallel-size",
        str(par.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(par.pipeline_parallel_size),
        "--data-parallel-size",
        str(par.data_parallel_size),
        "--max-model-len",
        str(plan.max_model_len),
    ]
    if options.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", repr(options.gpu_memory_utilization)]
    cmd += ["--dtype", _dtype_flag(plan, options), "--kv-cache-dtype", kv_cache_dtype_flag(plan)]
    block = forced_block_size(plan)
    if block is not None:
        cmd += ["--block-size", str(block)]
    cmd.append(
        "--enable-prefix-caching" if plan.enable_prefix_caching else "--disable-prefix-caching"
    )
    speculative = plan.speculative_config()
    if speculative is not None:
        # the drafter's cache layers are in the plan's groups: vLLM must build that drafter
        cmd += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
    transfer, notes = transfer_config(plan, options, disk_dir)
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    events, events_notes = kv_events_args(
        plan, options, user_args, events_ip, serving_port=port, port=events_port,
        host_name=socket.gethostname())
    cmd += events
    notes += events_notes
    # the pod's preStop drains through it (spillway_engine.launcher.drain)
    cmd += ["--middleware", drain.MIDDLEWARE]
    cmd += ["--host", host, "--port", str(port), *user_args]
    return cmd, notes


# -------------------------------------------------------------------- serving


def installed_vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def plugin_registered() -> bool:
    """Whether vLLM will find the Spillway plugin (entry point in vllm.general_plugins)."""
    return any(
        ep.name == ENTRY_POINT_NAME and ep.value.replace(" ", "") == ENTRY_POINT_VALUE
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    )


def serving_env(
    plan_path: Path,
    options_path: Path,
    base: Mapping[str, str],
    plugins: Sequence[str] = (ENTRY_POINT_NAME,),
) -> dict[str, str]:
    env = dict(base)
    env[ENV_PLAN] = str(plan_path.resolve())
    env[ENV_ENGINE_OPTIONS] = str(options_path.resolve())
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None:  # an allow-list: ours must be on it
        names = [n.strip() for n in allowed.split(",") if n.strip()]
        names += [p for p in plugins if p not in names]
        env["VLLM_PLUGINS"] = ",".join(names)
    return env


# ---------------------------------------------------------------- stand-ins


@dataclass(frozen=True)
class Overlay:
    """What a stand-in for the GPU adds to the planned launch (the emulated GPU:
    :mod:`spillway_engine.emulator.launch`), so the launcher needs to know none: more
    vLLM arguments, environment and platform plug-ins to allow, notes for the log, and
    whether vLLM pins the host pool (only a real GPU does)."""

    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    plugins: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    pins: bool = True


#: Builds a stand-in's overlay from the plan, the serving options, the parsed arguments
#: and the raw argv (None: the launch runs on the real GPU).
OverlayFor = Callable[[Plan, EngineOptions, argparse.Namespace, Sequence[str]], Overlay | None]


def _argv(cmd: list[str], env: Mapping[str, str]) -> list[str]:
    # The vllm of this interpreter's environment (whose version was checked), else
    # PATH's, else the same CLI through this interpreter.
    beside = Path(sys.executable).with_name(cmd[0])
    exe = str(beside) if os.access(beside, os.X_OK) else shutil.which(cmd[0], path=env.get("PATH"))
    program = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return [*program, *cmd[1:]]


def _exec(cmd: list[str], env: dict[str, str]) -> int:
    argv = _argv(cmd, env)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, env)
    except OSError as e:
        raise EngineCliError(f"cannot start vLLM ({argv[0]}): {e.strerror or e}") from None
    return 0  # not reached


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not between 1 and 65535")
    return value


def positive(kind: type, zero: bool = False) -> Any:
    """An argparse type: a finite number > 0 (>= 0 with ``zero``); ints may be
    written as ``256e6``."""

    def parse(text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value >= 0 if zero else value > 0
        if not (low_ok and math.isfinite(value)) or (kind is int and not value.is_integer()):
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} {'>= 0' if zero else '> 0'}")
        return kind(value)

    return parse


def serve_parser() -> argparse.ArgumentParser:
    """``spillway-engine serve``'s options; a stand-in adds its own (spillway_engine.cli)."""
    p = _Parser(
        prog=f"{PROG} serve",
        description=f"Start vLLM {VLLM_VERSION} exactly as the Spillway plan says, with the "
        "start-up plan check.",
    )
    p.add_argument("--plan", required=True, metavar="PATH", help="plan.json")
    p.add_argument(
        "--engine-options",
        metavar="PATH",
        help=f"serving options (default: {ENGINE_OPTIONS_FILE} beside the plan)",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    p.add_argument(
        "--kv-events-port", type=_port, metavar="PORT",
        help="base port of the KV-event publishers, rank r on PORT + r (default: engine.json's "
        "kv_events_port; engines sharing one address each need their own)")
    p.add_argument(
        "--shm-dir",
        metavar="PATH",
        help="the pod's shm folder, freed of an earlier engine's leftovers and checked for "
        "room before vLLM starts (default: $SPILLWAY_SHM_DIR or /dev/shm)",
    )
    p.add_argument(
        "--cgroup-root",
        metavar="PATH",
        help="where the container's memory cgroup files are (default: $SPILLWAY_CGROUP_ROOT "
        "or /sys/fs/cgroup)",
    )
    p.add_argument(
        "--disk-dir",
        metavar="PATH",
        default=DISK_TIER_MOUNT,
        help=f"where the plan's disk tier keeps its files (default: {DISK_TIER_MOUNT}, "
        "the pod's volume)",
    )
    nodes = p.add_argument_group(
        "several nodes (one vLLM instance over a LeaderWorkerSet group; no Ray)")
    nodes.add_argument(
        "--nnodes", type=positive(int), default=1, metavar="N",
        help="pods (nodes) the replica spans; every pod runs the same command (default 1)")
    nodes.add_argument(
        "--node-rank", type=positive(int, zero=True), metavar="R",
        help=f"this node's rank, 0 for the leader (default: ${multinode.ENV_WORKER_INDEX})")
    nodes.add_argument(
        "--master-addr", metavar="HOST",
        help=f"the leader's address (default: ${multinode.ENV_LEADER_ADDRESS})")
    nodes.add_argument(
        "--leader-timeout", type=float, default=multinode.LEADER_WAIT_S, metavar="SECONDS",
        help="how long a worker (node rank > 0) waits for the leader's port before it "
        f"stops with the reason (default {multinode.LEADER_WAIT_S:.0f})")
    nodes.add_argument(
        "--master-port", type=_port, default=multinode.DIST_PORT, metavar="PORT",
        help="torch.distributed's rendezvous (and data-parallel RPC) port on the leader "
        f"(default {multinode.DIST_PORT})")
    p.add_argument("extra", nargs="*", metavar="-- VLLM_ARG", help="more vLLM arguments")
    return p


def node_of(args: argparse.Namespace, env: Mapping[str, str]) -> multinode.Node:
    """This pod's place in its replica, from the flags or LeaderWorkerSet's environment."""
    try:
        return multinode.node_from(
            args.nnodes, env, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port)
    except multinode.MultiNodeError as e:
        raise EngineCliError(str(e)) from None


def parallel_launch(plan: Plan, node: multinode.Node) -> tuple[list[str], dict[str, str]]:
    """:func:`multinode.parallel_launch`, its refusals as EngineCliError."""
    try:
        return multinode.parallel_launch(plan, node)
    except multinode.MultiNodeError as e:
        raise EngineCliError(str(e)) from None


def serve_main(argv: Sequence[str], parser: argparse.ArgumentParser | None = None,
               overlay_for: OverlayFor | None = None) -> int:
    """``parser``: serve_parser() with a stand-in's options added; ``overlay_for``: that
    stand-in's overlay (the command line, :mod:`spillway_engine.cli`, wires both)."""
    args = (parser or serve_parser()).parse_args(list(argv))
    plan_path = Path(args.plan)
    options_path = (
        Path(args.engine_options) if args.engine_options else plan_path.parent / ENGINE_OPTIONS_FILE
    )
    plan = load_plan(plan_path)
    options = load_engine_options(options_path)
    events_ip = events_bind_ip(args.host, os.environ)
    cmd, notes = build_command(
        plan, options, host=args.host, port=args.port, extra_args=args.extra, events_ip=events_ip,
        events_port=args.kv_events_port, disk_dir=args.disk_dir,
    )
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None and "--prefix-caching-hash-algo" in cmd:
        # vLLM seeds the first block hash with it instead of "vllm-none-hash"
        notes.append(f"KV events: block hashes seeded by PYTHONHASHSEED={seed} (give "
                     f"spillway-router --hash-seed {seed})")
    node = node_of(args, os.environ)
    planned_nodes = getattr(plan.parallelism, "nodes", None)
    if isinstance(planned_nodes, int) and planned_nodes > 1 and planned_nodes != node.nnodes:
        raise EngineCliError(
            f"the plan was made for {planned_nodes} nodes, but --nnodes is {node.nnodes} "
            "(its per-pod figures would not hold)")
    spread, spread_env = parallel_launch(plan, node)
    cmd += spread
    if node.nnodes > 1:
        notes.append(
            f"node {node.rank} of {node.nnodes} "
            f"({'headless: probes answered by the launcher' if node.headless else 'leader'}), "
            f"torch.distributed at {node.master_addr}:{node.master_port}")
    overlay = (overlay_for(plan, options, args, argv) if overlay_for else None) or Overlay()
    cmd += overlay.args
    notes += overlay.notes
    if args.dry_run:
        for note in notes:
            print(f"{PROG}: note: {note}", file=sys.stderr)
        print(shlex.join(cmd))
        return 0
    _check_install(plan)
    check_event_ports(plan, options, cmd, node, events_ip, args.kv_events_port, args.extra)
    for note in notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    # vLLM and the GPU workers pin the region only on a real GPU, and only with offloading.
    prepare_host(
        plan,
        shm_dir(args.shm_dir),
        preflight.cgroup_root(args.cgroup_root),
        offload=options.offload_enabled,
        pins=options.offload_enabled and overlay.pins,
        disk=Path(args.disk_dir),
    )
    print(f"{PROG}: {'start' if node.headless else 'exec'} {shlex.join(cmd)}", file=sys.stderr)
    env = serving_env(plan_path, options_path, os.environ, [ENTRY_POINT_NAME, *overlay.plugins])
    env.update(spread_env)
    env.update(overlay.env)
    if node.headless:
        try:
            waited = multinode.wait_for_leader(node, args.leader_timeout)
        except multinode.MultiNodeError as e:
            raise EngineCliError(str(e)) from None
        print(f"{PROG}: leader {node.master_addr}:{node.master_port} reached after "
              f"{waited:.0f} s", file=sys.stderr)
        try:
            return headless.run_headless(_argv(cmd, env), env, args.host, args.port)
        except OSError as e:
            raise EngineCliError(str(e)) from None
    return _exec(cmd, env)


def check_event_ports(plan: Plan, options: EngineOptions, cmd: Sequence[str],
                      node: multinode.Node, events_ip: str | None,
                      base: int | None, extra: Sequence[str] = ()) -> None:
    """Stop with a line naming it when a KV-event port of this pod's ranks is taken
    (only for the events the launcher configured: extra args' are the user's)."""
    if "--kv-events-config" not in cmd or kv_events.user_sets(
            [*options.extra_args, *extra], "--kv-events-config"):
        return
    first = options.kv_events_port if base is None else base
    ranks = kv_events.local_ranks(plan.parallelism.data_parallel_size, node.nnodes, node.rank)
    try:
        kv_events.check_ports_free(events_ip, [first + r for r in ranks])
    except kv_events.EventPortTaken as e:
        raise EngineCliError(str(e)) from None


def _check_install(plan: Plan) -> None:
    """The vLLM the plan was made for, and Spillway's plugin registered with it."""
    found = installed_vllm_version()
    if found != plan.vllm_version:
        raise EngineCliError(
            f"the plan needs vLLM {plan.vllm_version}, but "
            + (f"vLLM {found} is installed" if found else "vLLM is not installed")
        )
    if not plugin_registered():
        raise EngineCliError(
            f"the Spillway vLLM plugin is not registered (entry point {ENTRY_POINT_NAME} = "
            f"{ENTRY_POINT_VALUE} in group {ENTRY_POINT_GROUP}); without it the start-up "
            "plan check cannot run -- reinstall the spillway package"
        )


def prepare_host(plan: Plan, shm: Path, cgroups: Path, *, offload: bool, pins: bool,
                 disk: Path | None = None) -> None:
    """Free the shm folder of an earlier engine's leftovers, then check the container
    holds the plan. Raises PreflightShortfall (one line) when it does not."""
    if not shm.is_dir():
        raise PreflightShortfall(f"the shm folder {shm} does not exist (--shm-dir)")
    try:
        cleanup = free_leftovers(shm)
    except OSError as e:
        raise PreflightShortfall(f"cannot list the shm folder {shm}: {e.strerror or e}") from None
    for line in cleanup.log_lines():
        print(f"{PROG}: {line}", file=sys.stderr)
    if not offload:
        print(f"{PROG}: preflight skipped: offloading disabled in engine.json", file=sys.stderr)
        return
    try:
        facts = preflight.read_facts(shm, cgroups)
    except preflight.PreflightError as e:
        raise PreflightShortfall(str(e)) from None
    found = preflight.shortfalls(plan, facts, shm, pins=pins, disk=disk)
    for s in found:
        if not s.fatal:
            print(f"{PROG}: warning: preflight: {s.check}: {s.line}", file=sys.stderr)
    fatal = [s for s in found if s.fatal]
    if fatal:
        raise PreflightShortfall(
            "preflight: " + "; also ".join(f"{s.check}: {s.line}" for s in fatal)
        )
    print(f"{PROG}: {preflight.summary(plan, facts, shm)}", file=sys.stderr)
