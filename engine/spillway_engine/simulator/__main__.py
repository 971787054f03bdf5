"""``spillway-engine simulate``: serve one simulated vLLM 0.33.0 replica on loopback.

Wire it as a subcommand with :func:`simulate_main` (``argv`` without the word
``simulate``), or run ``python -m spillway_engine.simulator --plan plan.json``.
Every usage problem (bad plan, busy port, a host outside 127.0.0.0/8, ...) prints one
line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import socket
import sys
from collections.abc import Sequence

from aiohttp import web

from spillway_engine.simulator.core import EngineCore, LatencyModel, SchedulerConfig
from spillway_engine.simulator.plan_input import (
    DEFAULT_GPU_KV_TOKENS,
    PlanError,
    default_gpu_blocks,
    gpu_blocks_for_tokens,
    load_plan,
)

PROG = "spillway-engine simulate"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2, no usage dump
        raise UsageError(message)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or _Parser(prog=PROG, description="Serve a simulated vLLM 0.33.0 replica.")
    p.add_argument("--plan", required=True, help="plan JSON (spillway plan --format json)")
    p.add_argument("--host", default="127.0.0.1", help="address in 127.0.0.0/8")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpu-kv-blocks", type=int, help="GPU KV blocks (all groups)")
    size.add_argument(
        "--gpu-kv-tokens",
        type=int,
        help=f"GPU KV size in tokens (default: {DEFAULT_GPU_KV_TOKENS}; the plan has no GPU "
        "size, vLLM measures it at start-up)",
    )
    p.add_argument("--speed", type=float, default=1.0, help="modelled seconds per wall second")
    p.add_argument("--served-model-name", help="model name (default: the plan's model)")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    p.add_argument("--max-model-len", type=int, help="default: the plan's max_model_len")
    p.add_argument(
        "--pcie-gbps",
        type=float,
        default=LatencyModel.pcie_bytes_per_s / 1e9,
        help="effective host<->GPU bandwidth per GPU, GB/s",
    )
    return p


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be positive, got {value}")


def build_core(args: argparse.Namespace) -> EngineCore:
    for name in (
        "gpu_kv_blocks",
        "gpu_kv_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "speed",
        "pcie_gbps",
    ):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    plan = load_plan(args.plan)
    if args.gpu_kv_blocks:
        blocks = args.gpu_kv_blocks
    elif args.gpu_kv_tokens:
        blocks = gpu_blocks_for_tokens(plan, args.gpu_kv_tokens)
    else:
        blocks = default_gpu_blocks(plan)
    return EngineCore(
        plan,
        gpu_blocks=blocks,
        latency=LatencyModel(pcie_bytes_per_s=args.pcie_gbps * 1e9),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
        seed=args.seed,
    )


def bind_loopback(host: str, port: int) -> socket.socket:
    try:
        address = ipaddress.ip_address(host)
    except ValueError as e:
        raise UsageError(f"--host must be an IPv4 address in 127.0.0.0/8, got {host!r}") from e
    if address.version != 4 or address not in LOOPBACK:
        raise UsageError(f"--host must be an address in 127.0.0.0/8, got {host}")
    if not 0 < port < 65536:
        raise UsageError(f"--port must be between 1 and 65535, got {port}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A pod IP is reused for the next pod; connections of the last one may still be in
    # TIME_WAIT, which is no reason to refuse (a live listener still makes bind fail).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve(core: EngineCore, sock: socket.socket, speed: float, model_name: str | None):
    from spillway_engine.simulator.server import SimulatorApp

    sim = SimulatorApp(core, speed=speed, model_name=model_name)
    runner = web.AppRunner(sim.build(), access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    print(
        f"{PROG}: serving {sim.model_name} on http://{host}:{port} "
        f"(gpu blocks {core.gpu.total}, host chunks {core.plan.num_chunks}, speed {speed})",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator; returns the exit status (2 for usage errors)."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        core = build_core(args)
        sock = bind_loopback(args.host, args.port)
    except (UsageError, PlanError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(core, sock, args.speed, args.served_model_name))
    return 0


if __name__ == "__main__":
    sys.exit(simulate_main())
