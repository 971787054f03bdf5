"""Which pod serves a request: the longest cached prefix, a host-tier hit weighted by
what it saves, against load; cold prefixes by consistent hashing with bounded load.

Everything here is pure: pods, their matches and loads in, a decision out.

The estimate minimised is the time to first token on each pod:

    wait(load) + prefill(tokens not cached) + transfer(tokens found on the host)
               + load(tokens found only on disk)

A host hit saves its prefill and costs its transfer over the pod's host<->GPU
bandwidth, with the bytes per token the pod's plan gives; when the transfer is
slower than recomputing, the host hit scores as nothing (vLLM would still load it,
but it is no reason to pick the pod). A disk hit is weighed the same way, its
transfer :data:`DISK_LOAD_FACTOR` times as long as a host copy of the same bytes, so
it ranks below a host hit and, capped at recomputing, never below no hit at all.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .index import Match

#: Pods may be loaded up to this factor of the mean (plus one request) before a
#: request looks elsewhere (consistent hashing with bounded loads).
DEFAULT_BALANCE = 1.25
#: ... and a pod holding part of the prompt up to this factor.
WARM_BALANCE = 4.0
#: A chunk loaded from Spillway's disk tier takes this many times as long as a copy of
#: it from the host pool. Measured on this project's build machine with
#: ``python -m bench.disk_tier`` (chunk files of real plans, read by the disk tier's own
#: read call): a cold load (the file's pages dropped from the page cache, so the read
#: goes to the device) is ~11x a host copy, a warm one (pages still cached) ~3x. The
#: cold figure is taken: a disk tier is sized beyond host memory, so most of it is not
#: in the page cache. ``spillway-router --disk-load-factor`` sets another.
DISK_LOAD_FACTOR = 11.0


@dataclass(frozen=True)
class CostModel:
    """Per-pod figures, from its plan and the router's flags."""

    tokens_per_hash: int
    #: KV bytes one token occupies in the host tier, all groups (plan: chunk bytes / tokens).
    host_bytes_per_token: float = 0.0
    #: host -> GPU copy bandwidth, bytes/s.
    host_bandwidth: float = 25e9
    #: prefill time per uncached token, s.
    prefill_s_per_token: float = 1e-4
    #: queueing time one in-flight or waiting request adds, s.
    wait_s_per_request: float = 0.05
    #: KV bytes of one token in a disk chunk file, all groups (plan: disk chunk set bytes
    #: / tokens); None: as in the host tier (the files hold the host rows).
    disk_bytes_per_token: float | None = None
    #: a load from disk over a host copy of the same bytes (:data:`DISK_LOAD_FACTOR`).
    disk_load_factor: float = DISK_LOAD_FACTOR

    def transfer_s(self, tokens: int) -> float:
        if self.host_bandwidth <= 0:
            return math.inf
        return tokens * self.host_bytes_per_token / self.host_bandwidth

    def disk_transfer_s(self, tokens: int) -> float:
        """A load of ``tokens`` from disk into the GPU: the host copy's time of the
        file's bytes, times :attr:`disk_load_factor`."""
        if self.host_bandwidth <= 0:
            return math.inf
        per_token = (
            self.host_bytes_per_token
            if self.disk_bytes_per_token is None
            else self.disk_bytes_per_token
        )
        return tokens * per_token / self.host_bandwidth * max(1.0, self.disk_load_factor)

    def ttft_s(self, prompt_tokens: int, match: Match, load: float) -> float:
        gpu = match.gpu_units * self.tokens_per_hash
        host = match.host_units * self.tokens_per_hash
        disk = match.disk_units * self.tokens_per_hash
        gpu = min(gpu, prompt_tokens)
        host = min(host, prompt_tokens - gpu)
        disk = min(disk, prompt_tokens - gpu - host)
        # vLLM recomputes at least the last token, and prefers recomputing a host (or
        # disk) hit that would cost more to load.
        host_cost = min(self.transfer_s(host), host * self.prefill_s_per_token)
        disk_cost = min(self.disk_transfer_s(disk), disk * self.prefill_s_per_token)
        rest = max(1, prompt_tokens - gpu - host - disk)
        return (
            load * self.wait_s_per_request
            + rest * self.prefill_s_per_token
            + host_cost
            + disk_cost
        )


@dataclass(frozen=True)
class PodState:
    name: str
    cost: CostModel
    load: float = 0.0  # in-flight plus waiting requests
    draining: bool = False  # marked for removal: no new requests
    #: its GPU pool's measured rate over the others' (rates.PoolRates): it may carry
    #: this many times the load bound
    weight: float = 1.0


@dataclass(frozen=True)
class Decision:
    pod: str
    reason: str  # "prefix" | "cold"
    cached_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    estimates: Mapping[str, float] = field(default_factory=dict)


class Ring:
    """A consistent-hash ring with virtual nodes: adding or removing a pod moves only
    the keys that pod gains or loses."""

    def __init__(self, pods: Sequence[str], vnodes: int = 64) -> None:
        points = []
        for pod in sorted(set(pods)):
            for v in range(vnodes):
                points.append((_h64(f"{pod}#{v}".encode()), pod))
        points.sort()
        self._points = [p for p, _ in points]
        self._pods = [pod for _, pod in points]
        self.members = frozenset(pods)

    def walk(self, key: int) -> Iterator[str]:
        """Distinct pods clockwise from ``key``."""
        if not self._points:
            return
        # mixed again, so keys that are not hashes (small ints) still spread
        point = _h64((key & ((1 << 64) - 1)).to_bytes(8, "big"))
        start = bisect.bisect_left(self._points, point)
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            pod = self._pods[(start + i) % n]
            if pod not in seen:
                seen.add(pod)
                yield pod
                if len(seen) == len(self.members):
                    return


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def cold_key(keys: Sequence[int], tokens: Sequence[int], session: str | None = None) -> int:
    """What a cold request sticks by: its session when it names one, else its first
    block (so every prompt sharing that block goes the same way), else its tokens."""
    if session:
        return _h64(session.encode())
    if keys:
        return keys[0]
    return _h64(repr(list(tokens[:64])).encode())


def load_bound(pods: Sequence[PodState], balance: float) -> float:
    """The most load a pod may carry before the next request goes elsewhere."""
    total = sum(p.load for p in pods)
    return math.ceil(balance * (total + 1) / max(1, len(pods)))


def choose(
    pods: Sequence[PodState],
    prompt_tokens: int,
    matches: Mapping[str, Match],
    ring: Ring,
    key: int,
    balance: float = DEFAULT_BALANCE,
    warm_balance: float = WARM_BALANCE,
) -> Decision:
    """The pod for one request. Raises ValueError when ``pods`` is empty.

    Cold requests keep to ``balance`` x the mean load; a pod holding part of the
    prompt may carry up to ``warm_balance`` x the mean, beyond which its cache no
    longer excuses the queue (the estimate weighs the two below that)."""
    if not pods:
        raise ValueError("no pod to choose from")
    live = [p for p in pods if not p.draining] or list(pods)
    bound = load_bound(live, balance)
    allowed = [p for p in live if p.load + 1 <= bound * p.weight] or live
    warm_bound = load_bound(live, max(balance, warm_balance))
    warm = [p for p in live if p.load + 1 <= warm_bound * p.weight
            and matches.get(p.name, Match()).units > 0]
    estimates = {
        p.name: p.cost.ttft_s(prompt_tokens, matches.get(p.name, Match()), p.load)
        for p in {*allowed, *warm}
    }
    if warm:
        best = min(warm, key=lambda p: (estimates[p.name], p.load, p.name))
        cold_pick = _ring_pick(allowed, ring, key)
        # A warm pod wins only when it beats the cold choice's estimate.
        if estimates[best.name] <= estimates[cold_pick.name]:
            m = matches[best.name]
            tph = best.cost.tokens_per_hash
            cached = min(prompt_tokens, m.units * tph)
            gpu = min(cached, m.gpu_units * tph)
            host = min(cached - gpu, m.host_units * tph)
            return Decision(
                best.name,
                "prefix",
                cached_tokens=cached,
                host_tokens=host,
                disk_tokens=cached - gpu - host,
                estimates=estimates,
            )
        return Decision(cold_pick.name, "cold", estimates=estimates)
    return Decision(_ring_pick(allowed, ring, key).name, "cold", estimates=estimates)


def _ring_pick(allowed: Sequence[PodState], ring: Ring, key: int) -> PodState:
    by_name = {p.name: p for p in allowed}
    for name in ring.walk(key):
        if name in by_name:
            return by_name[name]
    # pods not on the ring yet (just added): least loaded, then by name
    return min(allowed, key=lambda p: (p.load, p.name))
