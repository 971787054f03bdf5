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
