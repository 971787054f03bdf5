"""spillway-router against vLLM 0.33.0 itself.

1. The router's block hashes equal the engine's: vLLM's ``get_request_block_hasher``
   on a real ``Request``, for each algorithm and seed the router accepts, with and
   without a cache salt, and in both event encodings (bytes, 64-bit ints).
2. The router reads vLLM's own ``ZmqEventPublisher`` off a real socket.
3. Two emulated engines (``spillway-engine serve --emulate-gpu`` with the launcher's
   default KV events: sha256 block hashes, each publisher bound on the engine's own
   address at a base port of its own, as engines sharing one address need) behind
   ``spillway-router``, which finds the endpoints at each engine's
   ``/kv_event_sources``: requests sharing a
   prefix that was put on one engine *behind the router's back* land on that engine
   (its prefix-cache hits rise, the other's do not), so only the event-fed index
   can have sent them there; the prefix is then pushed into that engine's host tier
   and still followed there (host hits rise); then that engine is killed mid-run:
   requests fail over and the index forgets it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spillway_engine.emulator.tiny import write_model
from spillway_router.events import EventFeed, subscribe
from spillway_router.hashing import BlockHasher, HashConfig, external_key
from spillway_router.index import GPU, HOST, PrefixIndex
from spillway_router.scoring import Ring, cold_key
from tests.contract.test_emulated_engine import (
    MODELS,
    Server,
    _kill_group,
    _launch,
    _plan,
    _wait_ready,
    metrics,
    prompt,
)
from tests.helpers import http_get

# ------------------------------------------------------------------ 1. hashes


def _vllm_hashes(algo: str, block_size: int, tokens: list[int], salt: str | None) -> list[bytes]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)  # reads PYTHONHASHSEED now, as the engine does at start-up
    req = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(block_size, fn),
    )
    return list(req.block_hashes)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "0", "1234"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_hashes_equal_vllms(
    algo: str, seed: str | None, salt: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    tokens = prompt(7, 16 * 9 + 5)  # nine full blocks and a partial one
    theirs = _vllm_hashes(algo, 16, tokens, salt)
    ours = BlockHasher(HashConfig(16, algo, seed)).digests(tokens, salt)
    assert len(theirs) == 9
    assert ours == theirs
    # and as events carry them, in either encoding
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    as_ints = [maybe_convert_block_hash(h) for h in theirs]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    as_bytes = [maybe_convert_block_hash(h) for h in theirs]
    assert isinstance(as_ints[0], int) and isinstance(as_bytes[0], bytes)
    keys = BlockHasher(HashConfig(16, algo, seed)).keys(tokens, salt)
    assert [external_key(h) for h in as_ints] == [external_key(h) for h in as_bytes] == keys


def test_a_wrong_seed_or_unit_gives_other_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = prompt(8, 64)
    theirs = _vllm_hashes("sha256", 16, tokens, None)
    assert BlockHasher(HashConfig(16, "sha256", "1")).digests(tokens) != theirs
    assert BlockHasher(HashConfig(32, "sha256")).digests(tokens) != theirs[1::2]
    # a coarser group is keyed by every 2nd hash of the 16-token chain
    assert BlockHasher(HashConfig(16, "sha256")).digests(tokens)[1::2] == theirs[1::2]


# ------------------------------------------------------------------ 2. the wire


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reads_vllms_own_publisher() -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    port = _free_port()
    # vLLM binds only a wildcard endpoint (it connects to a named host)
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    digest = b"\x01" * 32

    def stored(hashes: list[Any], medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[1] * 16, block_size=16,
            lora_id=None, medium=medium, lora_name=None, group_idx=0,
        )  # fmt: skip

    async def run() -> PrefixIndex:
        index = PrefixIndex()
        feed = EventFeed("pod", index, lambda _pod: None)
        task = asyncio.create_task(subscribe(f"tcp://127.0.0.1:{port}", feed))
        try:
            # PUB drops what is sent before the subscription lands: repeat the
            # first batch until one arrives
            for _ in range(200):
                pub.publish(KVEventBatch(ts=time.time(), events=[stored([digest], GPU)]))
                await asyncio.sleep(0.05)
                if feed.batches:
                    break
            batches = feed.batches
            pub.publish(
                KVEventBatch(
                    ts=time.time(),
                    events=[stored([7, 8], HOST), BlockRemoved(block_hashes=[7], medium=HOST)],
                )
            )
            for _ in range(200):
                await asyncio.sleep(0.02)
                if feed.batches > batches:
                    break
            assert ("pod", GPU) in index.holders(external_key(digest))
            assert set(index.holders(8)) == {("pod", HOST)} and index.holders(7) == {}
            pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if index.size() == 0:
                    break
            assert feed.errors == 0
            return index
        finally:
            task.cancel()

    try:
        assert asyncio.run(run()).size() == 0
    finally:
        pub.shutdown()


def test_disk_tier_events_reach_the_router_through_vllms_publisher(tmp_path: Path) -> None:
    """Spillway's disk tier -> vLLM's OffloadingEventsTracker (what the offloading
    connector publishes) -> vLLM's ZmqEventPublisher -> the router's index, medium
    STORAGE: a store is held on disk, an eviction is not."""
    import numpy as np
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from spillway_engine.offloader.disk_tier import SpillwayDiskTier
    from spillway_router.index import DISK

    chunk = 8192
    primary = np.zeros((2, chunk), dtype=np.uint8)
    tier = SpillwayDiskTier(
        None, memoryview(primary), "SpillwayDiskTier", root_dir=str(tmp_path),
        budget_bytes=chunk, plan_key="p", n_read_threads=1, n_write_threads=1,
        enable_kv_events=True,
    )  # fmt: skip
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in (1, 2)]
    try:
        for job_id, key in enumerate(keys):  # one chunk fits: the second evicts the first
            primary[job_id] = job_id + 1
            tier.submit_store(TransferJob(job_id, [key], np.array([job_id], dtype=np.int32),
                                          False, ReqContext(req_id="r")))  # fmt: skip
            deadline = time.monotonic() + 10
            while not list(tier.get_finished_jobs()):
                assert time.monotonic() < deadline, "store never finished"
                time.sleep(0.01)
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
        events = list(tracker.take_events(tier.take_events()))
    finally:
        tier.shutdown()
    assert [e.medium for e in events] == [DISK] * 3
    first, second = (external_key(e.block_hashes[0]) for e in (events[0], events[2]))

    port = _free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")

    async def run() -> PrefixIndex:
        index = PrefixIndex()
        feed = EventFeed("pod", index, lambda _pod: None)
        task = asyncio.create_task(subscribe(f"tcp://127.0.0.1:{port}", feed))
        try:
            for _ in range(200):  # until the subscription lands
                pub.publish(KVEventBatch(ts=time.time(), events=[]))
                await asyncio.sleep(0.05)
                if feed.batches:
                    break
            batches = feed.batches
            pub.publish(KVEventBatch(ts=time.time(), events=events))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if feed.batches > batches:
                    break
            assert feed.errors == 0
            return index
        finally:
            task.cancel()

    try:
        index = asyncio.run(run())
    finally:
        pub.shutdown()
    assert index.holders(first) == {}
    assert index.holders(second) == {("pod", DISK): 1}


# ------------------------------------------------------------------ 3. engines

ROUTER_START_S = 60
NAME = "tiny"


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _router_metric(url: str, name: str, **labels: str) -> float:
    status, text = http_get(url + "/metrics")
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _wait(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}")


def _engine(root: Path, model_dir: Path) -> Server:
    plan = _plan(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "plan.json").write_text(plan.model_dump_json(indent=1))
    # KV events are the launcher's default: nothing about them here
    (root / "engine.json").write_text(json.dumps({"model": str(model_dir),
                                                  "served_model_name": NAME}))
    port = _free_port()
    proc = _launch(root / "plan.json", root / "engine.log", port, MODELS["llama"][1])
    return Server(root.name, proc, port, root / "engine.log", plan, 0.0)


def test_prefix_follows_the_events_and_failover_forgets(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path / "llama", MODELS["llama"][0])
    engines: list[Server] = []
    router = None
    try:
        engines = [_engine(tmp_path / f"pod{i}", model_dir) for i in range(2)]
        for e in engines:
            _wait_ready(e)
        # both bound 127.0.0.1 (their --host; IPv4-mapped so that vLLM binds it) on ports
        # of their own: no clash
        sources = [json.loads(http_get(e.url("/kv_event_sources"))[1]) for e in engines]
        endpoints = [s["0"]["endpoint"] for s in sources]
        assert all(re.fullmatch(r"tcp://\[::ffff:127\.0\.0\.1\]:\d+", ep)
                   for ep in endpoints), sources
        assert endpoints[0] != endpoints[1]
        for e in engines:
            assert "--prefix-caching-hash-algo sha256" in e.log_text()
        rport = _free_port()
        url = f"http://127.0.0.1:{rport}"
        cmd = [str(Path(sys.executable).with_name("spillway-router")), "--host", "127.0.0.1"]
        cmd += ["--port", str(rport), "--probe-interval", "0.5", "--log-level", "WARNING"]
        cmd += ["--tokenizer", f"{NAME}={model_dir}"]  # text as the engine tokenizes it
        for i, e in enumerate(engines):
            plan = tmp_path / f"pod{i}" / "plan.json"
            cmd += ["--backend", f"name=pod{i},model={NAME},url=http://127.0.0.1:{e.port},"
                    f"events=pod,plan={plan}"]  # fmt: skip
        log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 (closed in finally)
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip

        def ready() -> bool:
            try:
                return json.loads(http_get(url + "/healthz")[1])["ready_pods"] == {NAME: 2}
            except (OSError, ValueError, KeyError):
                return False

        _wait(ready, "the router to see both engines", ROUTER_START_S)

        # A prefix whose cold choice (the ring) is pod0, placed on pod1 directly.
        unit = engines[0].plan.tokens_per_hash
        hasher = BlockHasher(HashConfig(unit))
        ring = Ring(["pod0", "pod1"])

        def cold_choice(s: int) -> str:
            return next(ring.walk(cold_key(hasher.keys(prompt(s, 320)), [])))

        seed = next(s for s in range(100, 400) if cold_choice(s) == "pod0")
        shared = prompt(seed, 320)
        holder, other = engines[1], engines[0]
        status, _ = _post(holder.url("/v1/completions"),
                          {"model": NAME, "prompt": shared, "max_tokens": 2})  # fmt: skip
        assert status == 200
        _wait(lambda: _router_metric(url, "spillway_router_index_blocks",
                                     pod="pod1", source="events") >= 320 // unit,
              "pod1's KV events to reach the router's index")  # fmt: skip

        before = [metrics(e) for e in engines]
        for i in range(4):
            status, reply = _post(url + "/v1/completions",
                                  {"model": NAME, "prompt": shared + prompt(900 + i, 24),
                                   "max_tokens": 2})  # fmt: skip
            assert status == 200, reply
        after = [metrics(e) for e in engines]
        hits = [a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
                for a, b in zip(after, before, strict=True)]  # fmt: skip
        queries = [a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                   for a, b in zip(after, before, strict=True)]  # fmt: skip
        assert hits[1] >= 4 * 320 - 4 * unit  # each found the shared 320 tokens on pod1
        assert queries[0] == 0 and hits[0] == 0  # pod0 saw none of them
        assert _router_metric(url, "spillway_router_requests_total",
                              pod="pod1", reason="prefix") == 4  # fmt: skip

        # Text: the router tokenizes it with the model's tokenizer, as the engine does.
        # A text prompt whose cold choice is pod0, put on pod1 directly, is found there.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))

        def text_of(seed: int) -> str:
            words = [f"w{seed}x{i}" for i in range(40)]
            while len(tok.encode(" ".join(words))) < 200:
                words += words[:10]
            return " ".join(words)

        text = next(
            text_of(s)
            for s in range(50)
            if next(ring.walk(cold_key(hasher.keys(tok.encode(text_of(s))), []))) == "pod0"
        )
        n_text = len(tok.encode(text))
        assert n_text < 600
        gpu_before = _router_metric(url, "spillway_router_index_blocks", pod="pod1",
                                    source="events", tier="GPU")  # fmt: skip
        status, _ = _post(holder.url("/v1/completions"),
                          {"model": NAME, "prompt": text, "max_tokens": 2})  # fmt: skip
        assert status == 200
        _wait(lambda: _router_metric(url, "spillway_router_index_blocks", pod="pod1",
                                     source="events", tier="GPU")
              >= gpu_before + n_text // unit - 1, "the text prompt's events")  # fmt: skip
        before = [metrics(e) for e in engines]
        status, reply = _post(url + "/v1/completions",
                              {"model": NAME, "prompt": text + " and then some more",
                               "max_tokens": 2})  # fmt: skip
        assert status == 200, reply
        after = [metrics(e) for e in engines]
        q, h = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
        assert after[1][h] - before[1][h] >= (n_text // unit - 1) * unit
        assert after[0][q] == before[0][q]

        # The prefix pushed out of pod1's GPU cache into its host tier (again behind the
        # router's back): the router learns it from pod1's host-tier events and still
        # sends the prefix there, where it is loaded from the host.
        for s in range(500, 505):  # 5 x 600 tokens overflow the 1,280-token GPU cache
            body = {"model": NAME, "prompt": prompt(s, 600), "max_tokens": 2}
            status, _ = _post(holder.url("/v1/completions"), body)
            assert status == 200
        _wait(lambda: _router_metric(url, "spillway_router_index_blocks", pod="pod1",
                                     source="events", tier="CPU") >= 11,
              "pod1's host-tier events (one key per 256-token chunk)")  # fmt: skip
        before = [metrics(e) for e in engines]
        host_before = _router_metric(url, "spillway_router_expected_cached_tokens_total",
                                     tier="host")  # fmt: skip
        status, reply = _post(url + "/v1/completions",
                              {"model": NAME, "prompt": shared + prompt(990, 24),
                               "max_tokens": 2})  # fmt: skip
        assert status == 200, reply
        after = [metrics(e) for e in engines]
        ext = "vllm:external_prefix_cache_hits_total"
        assert after[1][ext] - before[1][ext] >= 256  # the chunk came from pod1's host tier
        q = "vllm:prefix_cache_queries_total"
        assert after[0][q] == before[0][q]
        host_after = _router_metric(url, "spillway_router_expected_cached_tokens_total",
                                    tier="host")  # fmt: skip
        assert host_after - host_before >= 256  # and the router expected it there

        # pod1 dies mid-run: the next requests fail over to pod0, pod1 is forgotten.
        _kill_group(holder.proc)
        for i in range(4):
            status, reply = _post(url + "/v1/completions",
                                  {"model": NAME, "prompt": shared + prompt(950 + i, 24),
                                   "max_tokens": 2})  # fmt: skip
            assert status == 200, reply
        _wait(lambda: _router_metric(url, "spillway_router_index_blocks",
                                     pod="pod1", source="events") == 0,
              "the router to forget pod1's blocks")  # fmt: skip
        assert json.loads(http_get(url + "/healthz")[1])["ready_pods"] == {NAME: 1}
        assert metrics(other)["vllm:prefix_cache_queries_total"] > 0
        # and pod0's own events now describe the shared prefix there
        _wait(lambda: _router_metric(url, "spillway_router_index_blocks",
                                     pod="pod0", source="events") >= 320 // unit,
              "pod0's KV events")  # fmt: skip
    finally:
        if router is not None:
            _kill_group(router)
        for e in engines:
            _kill_group(e.proc)
