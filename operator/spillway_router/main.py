"""``spillway-router``: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from .app import RouterApp, RouterConfig, RouterState
from .backends import (
    BackendSpecError,
    Profile,
    backend_from_spec,
    parse_backend_spec,
    profile_from_plan,
)
from .hashing import ALGORITHMS, HashConfig
from .scoring import DISK_LOAD_FACTOR
from .tokens import load_tokenizer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spillway-router",
        description="OpenAI-compatible proxy that routes each request to the replica "
        "holding its prefix (GPU or host tier).",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--epp-port",
        type=int,
        default=0,
        help="also serve the Gateway API Inference Extension's endpoint picker (Envoy "
        "ext_proc over gRPC) on this port, from the same state (0: off; GIE uses 9002)",
    )
    src = p.add_argument_group("backends")
    src.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="SPEC",
        help="a static pod: model=M,url=http://H:P[,name=N][,events=tcp://H:P|pod][,plan=PATH]"
        " (events=pod: ask the pod's /kv_event_sources)",
    )
    src.add_argument("--plan", help="plan.json for static backends that name none")
    src.add_argument(
        "--kube-namespace", help="watch this namespace's Spillway engine pods (in cluster)"
    )
    src.add_argument(
        "--events-port",
        type=int,
        default=5557,
        help="port of the KV event publisher of a watched pod without the spillway.dev/"
        "kv-events annotation (0: none); annotated pods declare theirs as kv-events* "
        "container ports (a multi-node leader lists them at /kv_event_sources)",
    )
    r = p.add_argument_group("routing")
    r.add_argument("--mode", choices=("events", "approx"), default="events")
    r.add_argument("--hash-algo", choices=ALGORITHMS, default="sha256")
    r.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED, when they set one")
    r.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="the model's tokenizer (a path or hub id; 'simulator' for the simulator)",
    )
    r.add_argument("--balance", type=float, default=1.25, help="bounded-load factor")
    r.add_argument("--host-bandwidth-gbs", type=float, default=25.0, help="host->GPU GB/s")
    r.add_argument("--prefill-us-per-token", type=float, default=100.0)
    r.add_argument("--wait-ms-per-request", type=float, default=50.0)
    r.add_argument(
        "--disk-load-factor",
        type=float,
        default=DISK_LOAD_FACTOR,
        help="a chunk load from the disk tier over a host copy of it (measured: ~11 cold, "
        "~3 warm; python -m bench.disk_tier)",
    )
    r.add_argument("--max-attempts", type=int, default=3)
    r.add_argument("--probe-interval", type=float, default=2.0, help="seconds")
    p.add_argument("--log-level", default="INFO")
    return p


def _profile(path: str | None) -> Profile:
    if not path:
        return Profile()
    from spillway_engine.planner.plan import read_plan

    return profile_from_plan(read_plan(Path(path).read_bytes(), path))


def build(args: argparse.Namespace) -> RouterApp:
    tokenizers = {}
    for spec in args.tokenizer:
        model, sep, path = spec.partition("=")
        if not sep or not model or not path:
            raise SystemExit(f"spillway-router: --tokenizer {spec!r}: give MODEL=PATH")
        tokenizers[model] = load_tokenizer(path)
    if args.balance < 1:
        raise SystemExit("spillway-router: --balance must be at least 1")
    try:
        HashConfig(16, args.hash_algo, args.hash_seed)
    except ValueError as e:
        raise SystemExit(f"spillway-router: {e}") from e
    config = RouterConfig(
        mode=args.mode,
        hash_algorithm=args.hash_algo,
        hash_seed=args.hash_seed,
        balance=args.balance,
        host_bandwidth=args.host_bandwidth_gbs * 1e9,
        prefill_s_per_token=args.prefill_us_per_token * 1e-6,
        wait_s_per_request=args.wait_ms_per_request * 1e-3,
        disk_load_factor=max(1.0, args.disk_load_factor),
        max_attempts=max(1, args.max_attempts),
        probe_interval_s=args.probe_interval,
        tokenizers=tokenizers,
    )
    router = RouterApp(RouterState(config))
    for spec in args.backend:
        try:
            fields = parse_backend_spec(spec)
            router.add_backend(backend_from_spec(fields, _profile(fields.get("plan", args.plan))))
        except (BackendSpecError, OSError, ValueError) as e:
            raise SystemExit(f"spillway-router: {e}") from e
    if args.kube_namespace:
        from .kube import PodWatch

        router.sources.append(PodWatch(args.kube_namespace, args.events_port or None))
    if not args.backend and not args.kube_namespace:
        raise SystemExit("spillway-router: give --backend (repeatable) or --kube-namespace")
    return router


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    router = build(args)
    app = router.build()
    if args.epp_port:
        from .epp import EndpointPickerServer

        picker = EndpointPickerServer(router.state, args.host, args.epp_port)

        async def start_picker(_: web.Application) -> None:
            await picker.start()

        async def stop_picker(_: web.Application) -> None:
            await picker.stop()

        app.on_startup.append(start_picker)
        app.on_cleanup.insert(0, stop_picker)
    web.run_app(app, host=args.host, port=args.port, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
