"""``bench/routing.py --gateway``: the routing paths behind a real Envoy, in real time.

The same seeded trace as bench/routing.py, replayed as streaming completions through
Envoy asking Spillway's endpoint picker, Envoy asking the Inference Extension's own
picker (GIE v1.2.0, built by tools/build.sh), spillway-router, and Envoy's plain round
robin, each on fresh simulator engines; what is measured is described in
bench/routing.py's docstring. Split from it to keep each file readable; run it through
``python bench/routing.py --gateway``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.routing_trace import (
    GPU_KV_TOKENS,
    ROOT,
    free_port,
    load_plan,
    trace,
    trace_messages,
)
from spillway_cli.loadgen import percentile
from spillway_engine.simulator.core import ReplayItem

# ------------------------------------------------------------------------- --gateway

GATEWAY_PATHS = ("gateway + Spillway EPP", "gateway + GIE EPP", "spillway-router",
                 "gateway, round robin")
EPP, GIE, PROXY, ROUND_ROBIN = GATEWAY_PATHS
TEXT = "direct, text prompts"  # the engines, with GIE's load-test bodies
DUPLEX = "gateway + EPP, duplex"  # GIE's own body mode (fail closed), capacity only
GATEWAY_CLIENTS = 64
#: the engines' /metrics counters the hit shares are read from (summed over engines)
QUERIES, GPU_HITS, HOST_HITS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "spillway_host_hit_tokens_total",
)


def added(direct: list[float], routed: list[float], q: float) -> float:
    """What a path adds at percentile ``q``: its percentile less direct's (as --overhead)."""
    return (percentile(routed, q) or 0.0) - (percentile(direct, q) or 0.0)


def split(counts: list[float]) -> str:
    """Each engine's share of the prompt tokens, in percent: ``52/48``."""
    total = sum(counts) or 1.0
    return "/".join(f"{100 * c / total:.0f}" for c in counts)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_counters(address: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys((QUERIES, GPU_HITS, HOST_HITS), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


class Stack:
    """The processes of one measurement (engines, spillway-router, Envoys), on loopback;
    all stopped on exit. ``pin`` names the one core a process runs on (taskset)."""

    def __init__(self, workdir: Path, plan_path: Path) -> None:
        import os

        self.workdir, self.plan_path = workdir, plan_path
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT / 'engine'}:{ROOT / 'operator'}"}
        self.procs: list = []
        self.envoys: list = []
        workdir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for envoy in self.envoys:
            envoy.stop()
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def _start(self, name: str, cmd: list[str], pin: int | None = None):
        import shutil
        import subprocess

        if pin is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(pin), *cmd]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=(self.workdir / f"{name}.log").open("wb"))  # fmt: skip
        self.procs.append(proc)
        return proc

    def engines(self, addresses: list[str], speed: float) -> list[str]:
        """Simulators on these ``ip:port`` (127/8 IPs: a pod IP each, for GIE's pool)."""
        for i, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            self._start(f"engine-{i}", [
                sys.executable, "-m", "spillway_engine.simulator", "--plan", str(self.plan_path),
                "--host", host, "--port", port, "--speed", str(speed),
                "--served-model-name", "m", "--gpu-kv-tokens", str(GPU_KV_TOKENS),
                "--seed", str(i)])  # fmt: skip
        for a in addresses:
            _wait_http(f"http://{a}/health", lambda body: True)
        return addresses

    def router(self, addresses: list[str], pin: int | None = None) -> tuple[str, str, int]:
        """spillway-router (approximate index: the simulator publishes no KV events) with
        its endpoint picker: (proxy URL, picker host:port, pid)."""
        port, epp = free_port(), free_port()
        backends = [a for i, addr in enumerate(addresses) for a in (
            "--backend", f"model=m,url=http://{addr},name=e{i},plan={self.plan_path}")]
        proc = self._start("router", [
            sys.executable, "-m", "spillway_router.main", "--host", "127.0.0.1", "--port",
            str(port), "--epp-port", str(epp), "--mode", "approx", "--log-level", "WARNING",
            *backends], pin)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        n = len(addresses)
        _wait_http(url + "/healthz", lambda body: json.loads(body)["ready_pods"].get("m") == n)
        return url, f"127.0.0.1:{epp}", proc.pid

    def envoy(self, name: str, picker: str | None, addresses: list[str], pin: int | None = None,
              failure_mode: str = "FailOpen", gie: bool = False):  # fmt: skip
        """Envoy asking ``picker`` (None: round robin); ``gie``: in GIE's mode."""
        from e2e.gateway import Envoy, GatewayConfig
        from e2e.gateway.gie import gateway_config

        cfg = gateway_config(picker, addresses) if gie else GatewayConfig(
            picker=picker, endpoints=addresses, port=free_port(), admin_port=free_port(),
            failure_mode=failure_mode)  # fmt: skip
        envoy = Envoy(cfg, self.workdir / name)
        self.envoys.append(envoy)
        envoy.start()
        _pin(envoy.proc.pid, pin)
        return envoy

    def gie(self, addresses: list[str], pin: int | None = None, chars_per_token: float = 4.0):
        """GIE's own endpoint picker over these engines (e2e.gateway.gie), sized as its
        autoTune sizes it from a vLLM's cache_config_info, at ``chars_per_token``."""
        from e2e.gateway.gie import GiePicker

        block = json.loads(self.plan_path.read_text())["kv_groups"][0]["tokens_per_block"]
        picker = GiePicker(self.workdir / "gie", addresses, block_tokens=block,
                           gpu_blocks=GPU_KV_TOKENS // block,
                           chars_per_token=chars_per_token)  # fmt: skip
        self.envoys.append(picker)  # stopped first, as the Envoys are
        picker.start()
        _pin(picker.proc.pid, pin)
        return picker


def _pin(pid: int, core: int | None) -> None:
    """Every thread of a running process onto one core (taskset), when asked."""
    import shutil
    import subprocess

    if core is not None and shutil.which("taskset"):
        subprocess.run(["taskset", "-a", "-cp", str(core), str(pid)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip


def _wait_http(url: str, ok, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and ok(r.read()):
                    return
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not ready in {timeout:.0f} s")
        time.sleep(0.1)


async def _streamed(http, url: str, item: ReplayItem, messages=None) -> tuple[float, float] | None:
    """One trace request, streamed: (wall s to the first SSE data chunk, the engine's own
    modelled TTFT), or None when it failed. A completion of the prompt's ids, or given
    its ``messages``, a chat completion (the same ids at the engine)."""
    import aiohttp

    body = {"model": "m", "prompt": list(item.prompt), "max_tokens": item.max_tokens,
            "stream": True, "user": item.session}  # fmt: skip
    endpoint = "/v1/completions"
    if messages is not None:
        body.pop("prompt")
        body["messages"], endpoint = list(messages), "/v1/chat/completions"
    t0 = time.perf_counter()
    first = modelled = None
    try:
        async with http.post(url + endpoint, json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                if b'"spillway"' in line:
                    modelled = json.loads(line[5:])["spillway"]["ttft_s"]
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if first is None or modelled is None:
        return None
    return first, modelled


async def _replay(url: str, items: list[ReplayItem], speed: float,
                  messages: dict | None = None) -> list:  # fmt: skip
    """The trace in real time, ``speed`` times compressed (every request on time, however
    many are in flight); with ``messages`` (by rid), as chat completions."""
    import asyncio

    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        tasks = []
        for item in items:
            delay = start + item.arrival / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            chat = None if messages is None else messages[item.rid]
            tasks.append(asyncio.create_task(_streamed(http, url, item, chat)))
        return await asyncio.gather(*tasks)


@dataclass
class GatewayRow:
    path: str
    requests: int
    errors: int
    gpu_share: float
    host_share: float
    split: str
    p50: float  # client-measured TTFT, wall s
    p95: float
    model_p50: float  # the engines' own TTFT, modelled s
    fallbacks: int  # requests Envoy sent on without the picker's answer (failing open)
    added_p50: float = 0.0
    added_p99: float = 0.0


def gateway_path(path: str, items: list[ReplayItem], workdir: Path, plan_path: Path,
                 addresses: list[str], speed: float, messages: dict) -> GatewayRow:  # fmt: skip
    """The trace through one path, on fresh (cold) engines and a fresh router (or GIE's
    picker, sent the trace as chat messages: it refuses token-id prompts)."""
    import asyncio

    with Stack(workdir, plan_path) as stack:
        stack.engines(addresses, speed)
        envoy = None
        if path == GIE:
            picker = stack.gie(addresses, chars_per_token=_chars_per_token(items, messages))
            envoy = stack.envoy("envoy", picker.picker, addresses, gie=True)
            url = envoy.url
        elif path == ROUND_ROBIN:
            envoy = stack.envoy("envoy", None, addresses)
            url = envoy.url
        else:
            url, picker, _ = stack.router(addresses)
            if path in (EPP, DUPLEX):
                mode = "FailClose" if path == DUPLEX else "FailOpen"
                envoy = stack.envoy("envoy", picker, addresses, failure_mode=mode)
                url = envoy.url
        got = asyncio.run(_replay(url, items, speed, messages if path == GIE else None))
        counters = [_engine_counters(a) for a in addresses]
        fallbacks = 0
        if envoy is not None:
            fallbacks = envoy.stats().get("http.gateway.ext_proc.failure_mode_allowed", 0)
    ok = [g for g in got if g is not None]
    queries = sum(c[QUERIES] for c in counters) or 1.0
    return GatewayRow(
        path,
        len(items),
        len(items) - len(ok),
        sum(c[GPU_HITS] for c in counters) / queries,
        sum(c[HOST_HITS] for c in counters) / queries,
        split([c[QUERIES] for c in counters]),
        percentile([g[0] for g in ok], 50) or 0.0,
        percentile([g[0] for g in ok], 95) or 0.0,
        percentile([g[1] for g in ok], 50) or 0.0,
        int(fallbacks),
    )


async def _gateway_load(urls: dict[str, list[str]], pids: dict[str, list[int]], n: int,
                        seconds: float) -> tuple[dict, dict]:  # fmt: skip
    """Sequential requests direct and through each path (interleaved), then requests/s
    through each with ``GATEWAY_CLIENTS`` concurrent clients, and the CPU share of the
    processes in ``pids`` meanwhile. ``urls["direct"]`` are the engines themselves.
    Prompts are 2,048 token ids, or for GIE's picker (and ``TEXT``, its baseline) 2,048
    words, which the engines tokenize into as many ids."""
    import asyncio
    import itertools
    import random

    import aiohttp

    rng = random.Random(0)

    def body(text: bool = False) -> bytes:
        ids = [rng.randrange(16, 32000) for _ in range(2048)]
        prompt = " ".join(f"x{i}" for i in ids) if text else ids
        return json.dumps({"model": "m", "max_tokens": 1, "prompt": prompt}).encode()

    textual = (GIE, TEXT)

    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(url: str, data: bytes) -> float:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", data=data, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            return time.perf_counter() - t0

        for name, targets in urls.items():  # all up
            for url in targets:
                await one(url, body(name in textual))
        lat: dict[str, list[float]] = {name: [] for name in urls}
        for i in range(n):
            for name, targets in urls.items():
                lat[name].append(await one(targets[i % len(targets)], body(name in textual)))
        pools = {t: [body(t) for _ in range(512)] for t in (False, True)}  # before the clock
        load: dict[str, dict[str, float]] = {}
        for name, targets in urls.items():
            done = 0
            bodies = itertools.cycle(pools[name in textual])
            stop = time.perf_counter() + seconds

            async def client(k: int, targets: list[str] = targets, stop: float = stop,
                             bodies: Iterator[bytes] = bodies) -> None:  # fmt: skip
                nonlocal done
                while time.perf_counter() < stop:
                    await one(targets[k % len(targets)], next(bodies))
                    done += 1

            cpu0 = {k: sum(_cpu_s(p) for p in ps) for k, ps in pids.items()}
            t0 = time.perf_counter()
            await asyncio.gather(*(client(k) for k in range(GATEWAY_CLIENTS)))
            wall = time.perf_counter() - t0
            load[name] = {"rps": done / wall}
            for k, ps in pids.items():
                load[name][k] = (sum(_cpu_s(p) for p in ps) - cpu0[k]) / wall
    return lat, load


def _chars_per_token(items: list[ReplayItem], messages: dict) -> float:
    """Characters of the messages' JSON (what GIE's prefix scorer hashes) per prompt
    token, over the trace."""
    chars = sum(len(json.dumps(messages[it.rid], separators=(",", ":"))) for it in items)
    return chars / sum(len(it.prompt) for it in items)


def _gie_version() -> str:
    from e2e.cluster.controlplane import read_versions

    return read_versions()["GIE_VERSION"]


def gateway(duration: float, seed: int, n: int, speed: float, quick: bool) -> int:
    import os
    import tempfile

    plan, _ = load_plan()
    # the simulator exports no vllm:cache_config_info, so the router takes a pod's GPU
    # KV size from its plan's max_model_len: make that the engines' real GPU size
    plan = plan.model_copy(update={"max_model_len": GPU_KV_TOKENS})
    items = trace(n, duration, seed)
    messages = trace_messages(n, duration, seed)
    t_start = time.perf_counter()
    print(f"gateway: {n} simulator engines (GPU KV {GPU_KV_TOKENS} tokens, host tier "
          f"{plan.capacity_tokens} tokens each; speed {speed:g}), the routing trace of {n} "
          f"replicas: {len(items)} requests over {duration:.0f} virtual s = "
          f"{duration / speed:.0f} s wall per path; spillway-router --mode approx (the "
          f"simulator publishes no KV events); GIE v{_gie_version()}'s picker sent the same "
          f"prompts as chat messages, its prefix scorer at their "
          f"{_chars_per_token(items, messages):.1f} characters per token; fresh engines and "
          f"picker per path", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(plan.model_dump_json())
        from e2e.gateway.gie import pod_addresses

        addresses = pod_addresses(n)
        rows = {}
        for path in GATEWAY_PATHS:
            t0 = time.perf_counter()
            rows[path] = gateway_path(path, items, Path(tmp) / path.replace(" ", "_"),
                                      plan_path, addresses, speed, messages)  # fmt: skip
            print(f"  {path}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        # overhead and capacity: engines at speed 1000 (their modelled time negligible);
        # spillway-router (proxy and picker, one process) and GIE's picker on core 0 (one
        # of them loaded at a time), everything else (Envoys, engines, the API server
        # GIE reads, this client) on core 1
        cores = sorted(os.sched_getaffinity(0))
        pinned = len(cores) >= 2
        router_core, rest = (cores[0], cores[1]) if pinned else (None, None)
        before = os.sched_getaffinity(0)
        try:
            if pinned:
                os.sched_setaffinity(0, {rest})  # inherited by the processes started here
            with Stack(Path(tmp) / "load", plan_path) as stack:
                stack.engines(addresses, 1000.0)
                proxy, picker, rpid = stack.router(addresses, pin=router_core)
                gie = stack.gie(addresses, pin=router_core)
                with_gie = stack.envoy("envoy-gie", gie.picker, addresses, pin=rest, gie=True)
                with_epp = stack.envoy("envoy-epp", picker, addresses, pin=rest)
                duplex = stack.envoy("envoy-duplex", picker, addresses, pin=rest,
                                     failure_mode="FailClose")  # fmt: skip
                plain = stack.envoy("envoy-rr", None, addresses, pin=rest)
                direct = [f"http://{a}" for a in addresses]
                urls = {"direct": direct, EPP: [with_epp.url], DUPLEX: [duplex.url],
                        TEXT: direct, GIE: [with_gie.url], PROXY: [proxy],
                        ROUND_ROBIN: [plain.url]}  # fmt: skip
                envoys = [with_gie, with_epp, duplex, plain]
                pids = {"spillway": [rpid], "GIE": [gie.proc.pid],
                        "envoy": [e.proc.pid for e in envoys],
                        "engines": [p.pid for p in stack.procs if p.pid != rpid]}  # fmt: skip
                import asyncio

                lat, load = asyncio.run(_gateway_load(urls, pids, 100 if quick else 400,
                                                      3.0 if quick else 8.0))  # fmt: skip
        finally:
            os.sched_setaffinity(0, before)
    for path, row in rows.items():
        base = lat[TEXT if path == GIE else "direct"]  # the same prompts, straight in
        row.added_p50 = added(base, lat[path], 50)
        row.added_p99 = added(base, lat[path], 99)
    width = max(6, 3 * n)
    head = (f"{'path':<24} {'reqs':>5} {'err':>4} {'GPU hit':>8} {'host hit':>8} "
            f"{'split %':>{width}} {'TTFT p50':>9} {'TTFT p95':>9} {'model p50':>9} "
            f"{'+p50':>7} {'+p99':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for row in rows.values():
        print(f"{row.path:<24} {row.requests:>5} {row.errors:>4} {row.gpu_share:>8.1%} "
              f"{row.host_share:>8.1%} {row.split:>{width}} {row.p50 * 1e3:>7.1f}ms "
              f"{row.p95 * 1e3:>7.1f}ms {row.model_p50 * 1e3:>7.0f}ms "
              f"{row.added_p50 * 1e3:>5.1f}ms {row.added_p99 * 1e3:>5.1f}ms")  # fmt: skip
    for row in rows.values():
        if row.fallbacks:
            print(f"  {row.path}: {row.fallbacks} requests went on without the picker's "
                  f"answer (Envoy's ext_proc failure_mode_allowed: round robin)")  # fmt: skip
    where = (f"spillway-router and GIE's picker on core {router_core}, Envoy, engines and "
             f"client on core {rest}" if pinned else "unpinned (fewer than 2 cores)")
    print(f"\n{GATEWAY_CLIENTS} concurrent clients, max_tokens 1, 2,048-token prompts, "
          f"engines at speed 1000; {where}; CPU: share of one core")
    head = (f"{'path':<24} {'req/s':>6} {'spillway CPU':>12} {'GIE CPU':>8} {'Envoy CPU':>9} "
            f"{'engines CPU':>11}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, got in load.items():
        label = "direct to the engines" if name == "direct" else name
        print(f"{label:<24} {got['rps']:>6.0f} {got['spillway']:>12.0%} {got['GIE']:>8.0%} "
              f"{got['envoy']:>9.0%} {got['engines']:>11.0%}")  # fmt: skip
    print(f"({DUPLEX}: added latency p50 {added(lat['direct'], lat[DUPLEX], 50) * 1e3:.1f} "
          f"ms, p99 {added(lat['direct'], lat[DUPLEX], 99) * 1e3:.1f} ms; direct p50 "
          f"{(percentile(lat['direct'], 50) or 0) * 1e3:.1f} ms; "
          f"wall {time.perf_counter() - t_start:.0f} s)")  # fmt: skip
    return 0
