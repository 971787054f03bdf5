"""spillway_router.events.EventFeed: one pod's ZMQ frames into the index (pure; the
socket itself is exercised against vLLM's publisher in tests/contract)."""

from __future__ import annotations

import msgspec
import pytest

from spillway_router.events import EventFeed
from spillway_router.index import GPU, PrefixIndex


def frames(seq: int, events: list[dict]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, events, None])]


def stored(*hashes: int) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "medium": GPU}


def test_applies_batches_and_counts_gaps() -> None:
    index = PrefixIndex()
    seen: list[str] = []
    feed = EventFeed("a", index, seen.append)
    feed.handle(frames(0, [stored(1)]))
    feed.handle(frames(3, [stored(2)]))  # 1 and 2 were dropped by the publisher
    assert feed.gaps == 1 and feed.batches == 2 and seen == ["a", "a"]
    assert index.size("a") == 2


def test_a_restarted_publisher_means_an_empty_cache() -> None:
    index = PrefixIndex()
    feed = EventFeed("a", index, lambda _p: None)
    feed.handle(frames(5, [stored(1, 2)]))
    feed.handle(frames(0, [stored(3)]))  # the sequence starts again
    assert index.holders(1) == {} and set(index.holders(3)) == {("a", GPU)}


def test_bad_messages_are_counted_not_raised() -> None:
    index = PrefixIndex()
    feed = EventFeed("a", index, lambda _p: None)
    feed.handle([b"only one frame"])
    feed.handle([b"", b"short", b""])
    feed.handle([b"", (1).to_bytes(8, "big"), b"\xc1"])
    feed.handle(frames(2, [{"type": "Bogus"}]))
    assert feed.errors == 4 and feed.batches == 0 and index.size() == 0
    assert feed.dropped == {"frames": 2, "undecodable": 1, "malformed": 1, "oversized": 0,
                            "unknown_medium": 0}


def test_hostile_messages_are_counted_by_reason_and_the_feed_goes_on() -> None:
    """Bad msgpack, batches past the bounds, events of an unknown medium and values of
    the wrong type: each dropped and counted (the router's metric by reason), never
    raised, and the next good batch is applied."""
    from spillway_router import index as idx

    index = PrefixIndex()
    drops: list[tuple[str, str]] = []
    feed = EventFeed("a", index, lambda _p: None, lambda pod, why: drops.append((pod, why)))
    seq = iter(range(100))

    def send(payload: bytes) -> None:
        feed.handle([b"kv@10.0.0.1:8000@m", next(seq).to_bytes(8, "big"), payload])

    enc = msgspec.msgpack.encode
    send(b"\x92\xcb")  # truncated msgpack
    send(b"\xdd\xff\xff\xff\xff")  # an array claiming 4 billion items, none sent
    send(b"\x00" * (idx.MAX_BATCH_BYTES + 1))  # past the payload bound
    send(enc([0.0, [{"type": "AllBlocksCleared"}] * (idx.MAX_BATCH_EVENTS + 1)]))
    send(enc([0.0, [stored(*range(idx.MAX_BATCH_KEYS // 2)), stored(*range(idx.MAX_BATCH_KEYS))]]))
    send(enc([0.0, [{"type": "BlockStored", "block_hashes": [1], "medium": "NVME"},
                    {"type": "BlockStored", "block_hashes": [2], "medium": "TAPE"},
                    stored(3)]]))
    send(enc([0.0, [{"type": "BlockStored", "block_hashes": [1], "medium": ["GPU"]}]]))
    send(enc([0.0, [{"type": "BlockStored", "block_hashes": "abc", "medium": "GPU"}]]))
    send(enc([0.0, [{"type": "BlockStored", "block_hashes": [1.5], "medium": "GPU"}]]))
    send(enc({"ts": 0, "events": []}))
    send(enc([0.0, "events"]))
    send(enc([0.0, [stored(7)]]))
    assert feed.dropped == {"frames": 0, "undecodable": 2, "malformed": 5, "oversized": 3,
                            "unknown_medium": 2}
    assert [why for _, why in drops].count("oversized") == 3 and {p for p, _ in drops} == {"a"}
    # the good events of a batch with unknown media went in, and so did the last batch
    assert set(index.holders(3)) == {("a", GPU)} and set(index.holders(7)) == {("a", GPU)}
    assert index.holders(1) == {} and index.holders(2) == {}
    assert feed.batches == 2


def test_random_bytes_never_break_the_feed() -> None:
    import random

    rng = random.Random(46)
    feed = EventFeed("a", PrefixIndex(), lambda _p: None)
    for i in range(3000):
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        feed.handle([b"", i.to_bytes(8, "big"), payload])
    assert sum(feed.dropped.values()) + feed.batches == 3000


def test_the_router_counts_drops_in_its_metric() -> None:
    from prometheus_client import generate_latest

    from spillway_router.app import RouterState
    from spillway_router.main import build, parser

    state: RouterState = build(parser().parse_args(
        ["--backend", "model=m,url=http://127.0.0.1:1"])).state
    feed = state.event_feed("p")
    feed.handle([b"", (0).to_bytes(8, "big"), b"\xc1"])
    text = generate_latest(state.metrics.registry).decode()
    assert 'spillway_router_kv_events_dropped_total{reason="undecodable"} 1.0' in text
    assert 'spillway_router_kv_events_dropped_total{reason="oversized"} 0.0' in text


def test_endpoints_from_kv_event_sources() -> None:
    from spillway_router.events import event_endpoints

    def rank(endpoint: str, on: bool = True) -> dict:
        return {"enable_kv_cache_events": on, "publisher": "zmq", "endpoint": endpoint}

    # vLLM's answer: rank -> its publisher config, the bound endpoint in it
    sources = {"1": rank("tcp://10.0.0.5:41002"), "0": rank("tcp://10.0.0.5:41001")}
    assert event_endpoints(sources, "10.0.0.5") == [
        "tcp://10.0.0.5:41001", "tcp://10.0.0.5:41002"]  # fmt: skip
    # a wildcard is the pod's own address; off, unbound or local ranks are left out
    sources = {"0": rank("tcp://*:5557"), "1": rank("tcp://*:5558", on=False),
               "2": rank("tcp://*:0"), "3": rank("ipc:///tmp/x")}  # fmt: skip
    assert event_endpoints(sources, "10.0.0.6") == ["tcp://10.0.0.6:5557"]
    # the launcher's bind on an IPv4 pod IP (IPv4-mapped, so vLLM binds it)
    sources = {"0": rank("tcp://[::ffff:10.0.0.7]:5557"), "1": rank("tcp://[::FFFF:10.0.0.8]:5558")}
    assert event_endpoints(sources, "10.0.0.7") == ["tcp://10.0.0.7:5557", "tcp://10.0.0.8:5558"]
    assert event_endpoints({}, "h") == []
    with pytest.raises(ValueError):
        event_endpoints([], "h")


def test_a_leader_lists_the_data_parallel_ranks_of_its_whole_group() -> None:
    """DP across nodes: the leader's front-end learns every rank's publisher from the
    engines' handshakes, and each rank binds its own pod's IP (tcp://*:0 with
    VLLM_HOST_IP = SPILLWAY_POD_IP), so the worker pod's ranks keep their address and
    the router follows all of them under the leader's name."""
    from spillway_router.events import event_endpoints

    def rank(ip: str, port: int) -> dict:
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://{ip}:{port}"}

    leader, worker = "10.1.0.7", "10.1.1.9"
    sources = {str(r): rank(leader if r < 8 else worker, 41000 + r) for r in range(16)}
    endpoints = event_endpoints(sources, leader)
    assert len(endpoints) == 16
    assert endpoints[8:] == [f"tcp://{worker}:{41000 + r}" for r in range(8, 16)]
