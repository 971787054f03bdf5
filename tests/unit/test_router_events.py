"""spillway_router.events.EventFeed: one pod's ZMQ frames into the index (pure; the
socket itself is exercised against vLLM's publisher in tests/contract)."""

from __future__ import annotations

import msgspec

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
