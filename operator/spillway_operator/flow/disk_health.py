"""Whether the pods' disk-tier stores fail, from their scraped counters: pure, no I/O.

The engine counts each chunk store the disk refused (full, read-only, failing:
``spillway_disk_tier_write_failures_total``) and each it wrote
(``spillway_disk_tier_stores_total``), serves on without the store, and backs off (1 s
doubling to 30 s) before it tries the disk again, so a full volume shows as failures
that grow in bursts, not every interval. Hence a pod is failing from the interval its
failures grow until a store succeeds (the engine's own end of an episode) or ``hold``
seconds pass with no new failure (nothing was tried: no traffic, or the tier idle).

A pod without a usable pair of readings (the first scrape after a leader change, a
counter that went backwards on a restart, a scrape that failed) keeps what the status
said of it: a new leader neither clears nor invents the condition. Ready pods only: a
pod that went away is dropped from the list.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway_operator.flow.pressure import Sample
from spillway_operator.flow.status_model import DiskTierStatus

#: Sample keys (``pressure.COUNTERS``): failed and written chunk stores, over engines.
FAILURES = "disk_write_failures"
STORES = "disk_stores"
#: Listed in a message at most; the status lists every failing pod.
MAX_NAMED = 5


@dataclass(frozen=True)
class PodDisk:
    """What one pod's last scrape said: its counters and when its failures last grew
    (monotonic seconds; None: not failing)."""

    failures: float
    stores: float
    last_failure: float | None = None


def hold_seconds(interval: float) -> float:
    """How long a pod stays failing with no new failure and no store: past the engine's
    longest backoff (30 s) plus an interval, so a backing-off tier does not flap."""
    return max(60.0, 3 * interval)


def assess(seen: dict[str, PodDisk], samples: dict[str, Sample], ready: list[str],
           listed: list[str], now: float, hold: float
           ) -> tuple[dict[str, PodDisk], DiskTierStatus | None]:  # fmt: skip
    """This tick's memory per pod and ``status.diskTier`` (None while every store
    succeeds). ``seen``: the last tick's memory; ``samples``: this tick's scrapes by pod;
    ``ready``: the ready pods; ``listed``: the pods the live status names as failing."""
    memory: dict[str, PodDisk] = {}
    failing: list[str] = []
    grown = 0.0
    for pod in sorted(ready):
        sample, prev = samples.get(pod), seen.get(pod)
        if sample is None or FAILURES not in sample.values:
            # Not scraped this time (or no disk tier): nothing new is known.
            if sample is None and prev is not None:
                memory[pod] = prev
            if pod in listed:
                failing.append(pod)
            continue
        failures = sample.values[FAILURES]
        stores = sample.values.get(STORES, 0.0)
        if prev is None or failures < prev.failures or stores < prev.stores:
            # No pair to compare (new here, or the engine restarted): as the status says.
            carried = now if pod in listed else None
            memory[pod] = PodDisk(failures, stores, carried)
            if carried is not None:
                failing.append(pod)
            continue
        last = prev.last_failure
        if failures > prev.failures:
            grown += failures - prev.failures
            last = now
        elif stores > prev.stores or (last is not None and now - last > hold):
            last = None  # a store succeeded, or nothing failed for the hold window
        memory[pod] = PodDisk(failures, stores, last)
        if last is not None:
            failing.append(pod)
    if not failing:
        return memory, None
    return memory, DiskTierStatus(failing_pods=failing, write_failures=round(grown))


def degraded_message(status: DiskTierStatus) -> str:
    """The Degraded condition's message: which pods, and what it means for serving.
    No counts: the message stays the same while the same pods fail (no write per tick)."""
    pods = status.failing_pods or []
    named = ", ".join(pods[:MAX_NAMED]) + (f" and {len(pods) - MAX_NAMED} more"
                                           if len(pods) > MAX_NAMED else "")
    return (f"disk-tier stores failing on {named} (volume full, read-only or failing; "
            "spillway_disk_tier_write_failures_total): serving goes on, chunks the host "
            "pool evicts are not kept on disk")
