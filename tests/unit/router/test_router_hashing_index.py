"""spillway_router's block hashing and prefix index (pure; no vLLM). The hash
equality with vLLM's own function is in tests/contract/test_router_engines.py."""

from __future__ import annotations

import hashlib
import pickle

import msgspec
import pytest

from spillway_router.hashing import BlockHasher, HashConfig, external_key
from spillway_router.index import (
    GPU,
    HOST,
    ApproxTracker,
    EventError,
    Match,
    PrefixIndex,
    decode_batch,
)


def test_first_block_is_chained_on_the_seeded_none_hash() -> None:
    hasher = BlockHasher(HashConfig(block_size=4))
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((none, (1, 2, 3, 4), None), protocol=5)).digest()
    assert hasher.digests([1, 2, 3, 4, 5]) == [first]  # the partial tail is not hashed


def test_hashes_depend_on_the_whole_prefix_and_the_seed() -> None:
    h = BlockHasher(HashConfig(block_size=2))
    a = h.keys([1, 2, 3, 4])
    b = h.keys([9, 2, 3, 4])
    assert a[1] != b[1]  # same second block, different parent
    assert h.keys([1, 2, 3, 4, 5, 6])[:2] == a  # a prefix keeps its keys
    seeded = BlockHasher(HashConfig(block_size=2, seed="0")).keys([1, 2, 3, 4])
    assert seeded != a
    salted = h.keys([1, 2, 3, 4], cache_salt="tenant")
    assert salted[0] != a[0] and salted[1] != a[1]


def test_each_key_covers_exactly_the_prefix_up_to_its_block() -> None:
    h = BlockHasher(HashConfig(block_size=2))
    base = h.keys(list(range(8)))
    changed = h.keys([0, 1, 2, 3, 4, 99, 6, 7])
    # a group with 4-token blocks is keyed by base[1] and base[3] (every 2nd hash)
    assert changed[:2] == base[:2]
    assert changed[2] != base[2] and changed[3] != base[3]


def test_external_key_equates_bytes_and_int_events() -> None:
    digest = hashlib.sha256(b"x").digest()
    as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert external_key(digest) == external_key(as_int) == as_int


def test_bad_hash_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        HashConfig(block_size=16, algorithm="md5")
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        HashConfig(block_size=16, algorithm="xxhash")
    with pytest.raises(ValueError, match="positive"):
        HashConfig(block_size=0)


# ------------------------------------------------------------------ the index


def _stored(hashes, medium=GPU):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def _removed(hashes, medium=GPU):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_counts_repeated_announcements() -> None:
    idx = PrefixIndex()
    idx.apply_batch("a", [0.0, [_stored([1, 2], HOST), _stored([2, 3], HOST)]])
    idx.apply_batch("a", [0.0, [_removed([2], HOST)]])
    assert ("a", HOST) in idx.holders(2)  # announced twice, removed once
    idx.apply_batch("a", [0.0, [_removed([2], HOST)]])
    assert idx.holders(2) == {}
    assert idx.size("a") == 2
    assert idx.tier_size("a", HOST) == 2 and idx.tier_size("a", GPU) == 0


def test_tiers_are_separate_and_clear_forgets_a_pod() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [1])
    idx.store("a", HOST, [1])
    idx.store("b", GPU, [1])
    idx.remove("a", GPU, [1])
    assert set(idx.holders(1)) == {("a", HOST), ("b", GPU)}
    assert (idx.tier_size("a", GPU), idx.tier_size("a", HOST)) == (0, 1)
    idx.apply_batch("a", [0.0, [{"type": "AllBlocksCleared"}]])
    assert set(idx.holders(1)) == {("b", GPU)}
    assert idx.tier_size("a", HOST) == 0 and idx.tier_size("b", GPU) == 1
    idx.forget("b")
    assert idx.size() == 0 and idx.pods() == set()


def test_remove_of_an_unknown_hash_is_harmless() -> None:
    idx = PrefixIndex()
    idx.remove("a", GPU, [42])
    assert idx.size() == 0


@pytest.mark.parametrize(
    "batch",
    [
        "x",
        [0.0],
        [0.0, 5],
        [0.0, [5]],
        [0.0, [{"type": "Nope"}]],
        [0.0, [{"type": "BlockStored", "block_hashes": "ab"}]],
        [0.0, [{"type": "BlockStored", "block_hashes": [1.5]}]],
        [0.0, [_stored([1]), {"type": "BlockRemoved", "block_hashes": [None]}]],
    ],
)
def test_malformed_batches_are_refused_whole(batch) -> None:
    idx = PrefixIndex()
    with pytest.raises(EventError):
        idx.apply_batch("a", batch)
    assert idx.size() == 0


def test_decodes_vllm_wire_format() -> None:
    # EventBatch is array_like; events are tagged maps (vllm/distributed/kv_events.py)
    payload = msgspec.msgpack.encode([1.0, [_stored([b"\x00" * 31 + b"\x07"])], None])
    idx = PrefixIndex()
    assert idx.apply_batch("a", decode_batch(payload)) == 1
    assert ("a", GPU) in idx.holders(7)
    with pytest.raises(EventError):
        decode_batch(b"\xc1")
    # the disk tier under the host pool is the third tier
    assert idx.apply_batch("a", [0.0, [_stored([9], "STORAGE")]]) == 1
    assert idx.holders(9) == {("a", "STORAGE"): 1}
    # a medium this router does not know is not scored, and not an error
    assert idx.apply_batch("a", [0.0, [_stored([10], "TAPE")]]) == 1
    assert idx.holders(10) == {}


def test_match_splits_gpu_and_host_and_stops_at_a_hole() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [1, 2])
    idx.store("a", HOST, [3, 4, 6])
    idx.store("b", HOST, [1, 2, 3, 4, 5, 6])
    idx.store("c", GPU, [2, 3])  # no first block: nothing usable
    m = idx.match([1, 2, 3, 4, 5, 6], ["a", "b", "c", "d"])
    assert m["a"] == Match(2, 2)
    assert m["b"] == Match(0, 6)
    assert m["c"] == Match(0, 0) and m["d"] == Match(0, 0)


def test_match_tolerates_the_stride_of_coarse_groups() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [2, 4])  # a group keyed at every 2nd hash
    assert idx.match([1, 2, 3, 4, 5], ["a"], gap=2)["a"] == Match(4, 0)
    assert idx.match([1, 2, 3, 4, 5], ["a"], gap=1)["a"] == Match(0, 0)


def test_host_tier_keyed_once_per_chunk() -> None:
    idx = PrefixIndex()
    idx.store("a", GPU, [1, 2])
    idx.store("a", HOST, [4, 8])  # chunk-end keys of 4-block chunks
    keys = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert idx.match(keys, ["a"], gap=1, host_gap=4)["a"] == Match(2, 6)
    assert idx.match(keys, ["a"], gap=1, host_gap=1)["a"] == Match(2, 0)


def test_approx_tracker_spills_gpu_into_host_within_planned_capacity() -> None:
    idx = PrefixIndex()
    t = ApproxTracker(idx)
    t.set_capacity("a", gpu_units=2, host_units=3)
    t.record("a", [1, 2, 3, 4, 5, 6])
    assert t.held("a") == (2, 3)  # the oldest block is gone entirely
    assert idx.holders(1) == {}
    assert set(idx.holders(2)) == {("a", HOST)}
    assert set(idx.holders(6)) == {("a", GPU)}
    t.record("a", [2])  # touched again: back on the GPU, 5 spills
    assert set(idx.holders(2)) == {("a", GPU)}
    assert set(idx.holders(5)) == {("a", HOST)}
    assert t.held("a") == (2, 3)
    t.record("unknown", [1])  # a pod without a capacity is not tracked
    assert "unknown" not in idx.pods()
    t.set_capacity("a", gpu_units=1, host_units=0)  # a smaller plan shrinks it
    assert t.held("a") == (1, 0) and idx.size("a") == 1
    t.forget("a")
    assert idx.size() == 0
