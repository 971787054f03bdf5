"""spillway_router.scoring: longest prefix, host hits weighted by what they save,
load, consistent hashing with bounded load (pure)."""

from __future__ import annotations

from collections import Counter

import pytest

from spillway_router.index import Match
from spillway_router.scoring import CostModel, PodState, Ring, choose, cold_key, load_bound

COST = CostModel(
    tokens_per_hash=16,
    host_bytes_per_token=100_000,
    host_bandwidth=50e9,
    prefill_s_per_token=1e-4,
    wait_s_per_request=0.05,
)


def pods(*loads: float, cost: CostModel = COST) -> list[PodState]:
    return [PodState(f"p{i}", cost, load=x) for i, x in enumerate(loads)]


def test_longest_prefix_wins_at_equal_load() -> None:
    ps = pods(0, 0, 0)
    ring = Ring([p.name for p in ps])
    d = choose(ps, 1024, {"p1": Match(10, 0), "p2": Match(30, 0)}, ring, key=1)
    assert (d.pod, d.reason, d.cached_tokens) == ("p2", "prefix", 480)


def test_host_hit_counts_by_what_it_saves() -> None:
    ring = Ring(["p0", "p1"])
    matches = {"p0": Match(20, 0), "p1": Match(0, 50)}
    # fast host link: 800 tokens from the host beat 320 on the GPU
    fast = pods(0, 0)
    assert choose(fast, 1024, matches, ring, key=1).pod == "p1"
    # a link slower than recomputing: the host hit is worth nothing
    slow = pods(0, 0, cost=CostModel(16, 100_000, host_bandwidth=1e6))
    d = choose(slow, 1024, matches, ring, key=1)
    assert d.pod == "p0"
    assert slow[1].cost.ttft_s(1024, Match(0, 50), 0) == pytest.approx(
        slow[1].cost.ttft_s(1024, Match(), 0)
    )


def test_estimate_never_counts_more_than_the_prompt() -> None:
    # the whole prompt cached still leaves one token to compute
    t = COST.ttft_s(32, Match(10, 0), 0)
    assert t == pytest.approx(COST.prefill_s_per_token)


def test_load_outweighs_a_small_prefix() -> None:
    ps = pods(6, 0)
    ring = Ring(["p0", "p1"])
    d = choose(ps, 512, {"p0": Match(2, 0)}, ring, key=cold_key([], [1]))
    assert d.pod == "p1"
    # ... but a long prefix on a lightly loaded pod still wins
    d = choose(pods(1, 0), 4096, {"p0": Match(200, 0)}, ring, key=1)
    assert d.pod == "p0"


def test_bounded_load_caps_cold_requests() -> None:
    ps = pods(2, 0, 0, 0)
    assert load_bound(ps, 1.25) == 1  # ceil(1.25 x 3 / 4): only idle pods take cold ones
    ring = Ring([p.name for p in ps])
    picks = {choose(ps, 64, {}, ring, key=cold_key([k], [])).pod for k in range(200)}
    assert picks == {"p1", "p2", "p3"}


def test_a_held_prefix_may_outweigh_a_queue_up_to_the_warm_bound() -> None:
    # p0 holds 8,000 of 8,192 tokens: worth queueing behind 4 requests (0.2 s) ...
    ps = pods(4, 0, 0, 0)
    ring = Ring([p.name for p in ps])
    assert choose(ps, 8192, {"p0": Match(500, 0)}, ring, key=1).pod == "p0"
    # ... but among 8 pods, 10 in flight is past 4x the mean: the prefix is no excuse
    ps = pods(10, 0, 0, 0, 0, 0, 0, 0)
    assert load_bound(ps, 4.0) == 6
    d = choose(ps, 8192, {"p0": Match(500, 0)}, Ring([p.name for p in ps]), key=1)
    assert d.pod != "p0" and d.reason == "cold"


def test_draining_pods_take_no_new_requests_unless_alone() -> None:
    ps = [PodState("a", COST, draining=True), PodState("b", COST, load=3)]
    ring = Ring(["a", "b"])
    assert choose(ps, 256, {"a": Match(16, 0)}, ring, key=1).pod == "b"
    assert choose(ps[:1], 256, {}, Ring(["a"]), key=1).pod == "a"


def test_no_pods_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose([], 10, {}, Ring([]), key=1)


def test_cold_prefixes_stick_and_spread() -> None:
    names = [f"p{i}" for i in range(4)]
    ring = Ring(names)
    ps = pods(0, 0, 0, 0)
    picks = [choose(ps, 64, {}, ring, key=cold_key([k], [])).pod for k in range(2000)]
    again = [choose(ps, 64, {}, ring, key=cold_key([k], [])).pod for k in range(2000)]
    assert picks == again
    counts = Counter(picks)
    assert set(counts) == set(names)
    assert max(counts.values()) / min(counts.values()) < 2


def test_removing_a_pod_moves_only_its_keys() -> None:
    big = Ring(["a", "b", "c", "d"])
    small = Ring(["a", "b", "c"])
    moved = 0
    for k in range(0, 1 << 64, (1 << 64) // 3000):
        before = next(big.walk(k))
        after = next(small.walk(k))
        if before != "d":
            assert before == after
        else:
            moved += 1
    assert 0 < moved < 3000


def test_a_pod_missing_from_the_ring_is_still_reachable() -> None:
    ps = pods(0, 0)
    d = choose(ps, 64, {}, Ring(["p0"]), key=1)
    assert d.pod == "p0"
    d = choose(ps, 64, {}, Ring([]), key=1)
    assert d.pod in {"p0", "p1"}


def test_session_key_overrides_the_first_block() -> None:
    assert cold_key([5], [], "s1") == cold_key([6], [], "s1")
    assert cold_key([5], []) != cold_key([6], [])
    assert cold_key([], [1, 2]) == cold_key([], [1, 2])
