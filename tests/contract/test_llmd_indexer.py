"""Interop: llm-d's own KV-cache indexer reads Spillway's engines and agrees with
Spillway's index.

``tools/kvindexer`` (built by ``tools/build.sh kvindexer``: github.com/llm-d/llm-d-kv-cache
v0.9.0, pure Go, behind a stdin/stdout harness) subscribes to the KV events of two
emulated engines (``spillway-engine serve --emulate-gpu``, a full-attention Llama with
a small host pool and a disk tier under it), on the ports they publish on, under the
topic ``kv@<ip>:<port>@<model>``; Spillway's own index (the router's EventFeed and
PrefixIndex) subscribes to the same publishers. A workload fills each engine's GPU,
spills to the host pool and on to disk, so the events carry all three media (GPU, CPU,
STORAGE). Then every prompt sent, prefixes and extensions of some and prompts never
sent are scored by llm-d (its LongestPrefix scorer, tier weights gpu 1.0, cpu 0.8,
storage 0.4: keys from the event tokens, its own hash) and by the same rule over
Spillway's index (keys from vLLM's block hashes): the per-pod scores must be equal.

The harness must build: a build failure fails the test (a skipped interop check is
one nobody runs).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.engine_process import Server, get, kill_group
from spillway_router.events import EventFeed, event_endpoints, subscribe
from spillway_router.hashing import BlockHasher, HashConfig
from spillway_router.index import DISK, GPU, HOST, PrefixIndex
from tests.contract.test_disk_tier_engine import settle, start
from tests.contract.test_emulated_engine import complete, prompt

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = {GPU: 1.0, HOST: 0.8, DISK: 0.4}
MODEL = "tiny"  # the served model name engine_process writes
PROMPT_TOKENS = 512


def build_kvindexer() -> Path:
    """tools/build.sh kvindexer (cached under ~/.cache/spillway/bin); a failure fails."""
    done = subprocess.run([str(REPO / "tools" / "build.sh"), "kvindexer"], capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        pytest.fail(f"tools/build.sh kvindexer failed ({done.returncode}):\n{done.stderr[-4000:]}")
    [line] = [x for x in done.stdout.splitlines() if x.startswith("kvindexer=")]
    binary = Path(line.split("=", 1)[1]) / "kvindexer"
    assert binary.is_file(), binary
    return binary


class LlmdIndexer:
    """The harness process: one JSON command a line in, one JSON answer a line out."""

    def __init__(self, binary: Path, block_size: int, log: Path) -> None:
        weights = ",".join(f"{t.lower()}={w}" for t, w in WEIGHTS.items())
        self.stderr = open(log, "wb")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            [str(binary), "-model", MODEL, "-block-size", str(block_size), "-weights", weights],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        assert self.read() == {"ready": True}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"kvindexer exited ({self.proc.poll()})")
        return json.loads(line)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()


class SpillwayIndex:
    """Spillway's index fed by the same publishers, on an event loop of its own."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.feeds: list[tuple[str, EventFeed]] = []
        self.tasks: list[asyncio.Task] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def follow(self, pod: str, endpoint: str) -> None:
        feed = EventFeed(pod, self.index, lambda _pod: None)
        self.feeds.append((pod, feed))

        async def start() -> None:
            self.tasks.append(asyncio.create_task(subscribe(endpoint, feed)))
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def messages(self) -> dict[str, int]:
        def count() -> dict[str, int]:
            out: dict[str, int] = {}
            for pod, feed in self.feeds:
                out[pod] = out.get(pod, 0) + feed.batches + sum(feed.dropped.values())
            return out
        return self.call(count)

    def scores(self, keys: list[int], pods: list[str]) -> dict[str, tuple[float, set[str]]]:
        """llm-d's LongestPrefix rule over this index: per key the best weight of the
        tiers the pod holds it in, summed until the first key it does not hold; and
        the tiers that gave each key its weight."""
        def score() -> dict[str, tuple[float, set[str]]]:
            out = {}
            for pod in pods:
                total, tiers = 0.0, set()
                for key in keys:
                    held = [t for (p, t) in self.index.holders(key)
                            if p == (self.index.disk_holder(pod) if t == DISK else pod)]
                    if not held:
                        break
                    best = max(held, key=WEIGHTS.__getitem__)
                    total += WEIGHTS[best]
                    tiers.add(best)
                out[pod] = (total, tiers)
            return out
        return self.call(score)

    def close(self) -> None:
        async def stop() -> None:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _quiet(spillway: SpillwayIndex, llmd: LlmdIndexer, pods: list[str]) -> dict[str, int]:
    """Wait until both indexes have read every message the engines published (the
    same count, unchanged for 2 s); the counts."""
    deadline, last, since = time.monotonic() + 120, None, time.monotonic()
    while time.monotonic() < deadline:
        ours = spillway.messages()
        theirs = llmd.ask({"stats": True})["messages"]
        now = (ours, {p: theirs.get(p, 0) for p in pods})
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 2 and all(ours.get(p, 0) == now[1][p] for p in pods):
            return ours
        time.sleep(0.25)
    pytest.fail(f"the indexes did not settle on the same messages: {last}")


def test_llmds_indexer_scores_spillways_engines_as_spillways_index_does(tmp_path: Path):
    binary = build_kvindexer()
    engines: list[Server] = []
    llmd = spillway = None
    try:
        engines = [start(tmp_path / f"pod{i}", "llama", tmp_path / f"pod{i}" / "disk")
                   for i in range(2)]
        unit = engines[0].plan.tokens_per_hash
        assert all(not g.sliding_window for g in engines[0].plan.kv_groups)  # full attention
        pods = [f"127.0.0.1:{e.port}" for e in engines]
        llmd = LlmdIndexer(binary, unit, tmp_path / "kvindexer.log")
        spillway = SpillwayIndex()
        for pod, engine in zip(pods, engines, strict=True):
            sources = json.loads(get(engine.url("/kv_event_sources"))[1])
            assert sources["0"]["topic"] == f"kv@{pod}@{MODEL}"  # llm-d's form
            endpoints = event_endpoints(sources, "127.0.0.1")
            assert endpoints and llmd.ask({"subscribe": endpoints}) == {"ok": True}
            for endpoint in endpoints:
                spillway.follow(pod, endpoint)
        time.sleep(3)  # both subscriptions joined before the first event

        # GPU first; the fillers push the early prompts to the host pool and on to disk;
        # then one comes back from disk on pod0, and one is served by both pods
        sent: list[list[int]] = []
        for seed in range(40):
            tokens = prompt(4600 + seed, PROMPT_TOKENS)
            sent.append(tokens)
            targets = engines if seed == 39 else [engines[seed % 2]]
            for engine in targets:
                assert complete(engine, tokens, max_tokens=2)["choices"]
        complete(engines[0], sent[0], max_tokens=2)
        for engine in engines:
            settle(engine)
        counts = _quiet(spillway, llmd, pods)
        assert all(n > 0 for n in counts.values()), counts

        queries = sent + [t[:300] for t in sent[::5]] + [sent[0] + prompt(9, 64)]
        queries += [prompt(7000 + s, PROMPT_TOKENS) for s in range(4)]  # never sent
        hasher = BlockHasher(HashConfig(unit))
        agree, held, media, differ = 0, 0, set(), []
        for tokens in queries:
            theirs = llmd.ask({"score": tokens})["scores"]
            ours = spillway.scores(hasher.keys(tokens), pods)
            for pod in pods:
                score, tiers = ours[pod]
                media |= tiers
                held += score > 0
                if abs(theirs.get(pod, 0.0) - score) < 1e-9:
                    agree += 1
                else:
                    differ.append((pod, len(tokens), theirs.get(pod, 0.0), score, sorted(tiers)))
        pairs = len(queries) * len(pods)
        print(f"llm-d-kv-cache v0.9.0 vs Spillway's index: {agree}/{pairs} (pod, prompt) "
              f"scores equal over {len(pods)} pods x {len(queries)} prompts ({held} with a "
              f"cached prefix); media {sorted(media)}")
        assert media == {GPU, HOST, DISK}, media  # every tier took part
        assert held >= len(sent), held  # most prompts are held somewhere
        assert not differ, f"{len(differ)}/{pairs} differ (pod, tokens, llm-d, ours): {differ[:8]}"
        assert llmd.ask({"stats": True})["errors"] == 0
    finally:
        for engine in engines:
            kill_group(engine.proc)
        if llmd is not None:
            llmd.close()
        if spillway is not None:
            spillway.close()
