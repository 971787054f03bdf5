"""One session on the real nodes at a time.

tests/nodes, tests/product and the benches that start the real nodes (bench.node_faults,
bench.autoscale_replay --real-nodes) share the nodes and the cluster's folder; each holds
this lock for as long as it uses them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from e2e.cluster.errors import ClusterError

TIER_LOCK = Path("/run/spillway/nodes-tier.lock")


@contextlib.contextmanager
def tier_session(who: str = "another session") -> Iterator[None]:
    """Hold TIER_LOCK for the block; ClusterError at once if someone else holds it."""
    try:
        TIER_LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(TIER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except PermissionError:
        raise ClusterError(f"the real nodes need root (cannot write {TIER_LOCK})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ClusterError(f"{who} holds {TIER_LOCK}: one real-nodes session at a time") from None
    try:
        yield
    finally:
        os.close(fd)
