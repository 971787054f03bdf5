"""Subscription to one pod's vLLM KV events (ZMQ PUB, frames: topic, seq, msgpack
EventBatch). pyzmq comes with vLLM; it is imported only when a pod publishes.

Where a pod publishes: ``spillway-engine serve`` binds each data-parallel rank's
publisher on the pod's IP at a declared port (``kv-events``, ``kv-events-1``, ... in
the pod spec; spillway_router.kube reads them). A replica over several pods has ranks
on its worker pods too: vLLM 0.33 lists every rank's bound endpoint at
``GET /kv_event_sources`` on the leader's serving port (rank -> its KVEventsConfig);
:func:`event_endpoints` reads that answer.

What comes off the wire is untrusted: a message of the wrong shape, an undecodable or
malformed batch, one past the index's bounds (:data:`index.MAX_BATCH_BYTES`, events,
hashes) or an event of an unknown medium is dropped and counted by reason
(``spillway_router_kv_events_dropped_total``), and the subscription goes on. ZMQ itself
refuses a message past :data:`MAX_MESSAGE_BYTES` before it is held in memory (it drops
that connection and reconnects; the lost sequence numbers count as a gap).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .index import MAX_BATCH_BYTES, EventError, OversizedBatch, PrefixIndex, decode_batch

log = logging.getLogger("spillway.router.events")

#: ZMQ's own bound on a message (its MAXMSGSIZE on the subscription socket).
MAX_MESSAGE_BYTES = 4 * MAX_BATCH_BYTES
#: Why a message was dropped (the metric's ``reason`` label).
FRAMES, UNDECODABLE, MALFORMED, OVERSIZED, UNKNOWN_MEDIUM = (
    "frames", "undecodable", "malformed", "oversized", "unknown_medium")
DROP_REASONS = (FRAMES, UNDECODABLE, MALFORMED, OVERSIZED, UNKNOWN_MEDIUM)


class EventFeed:
    """Applies one pod's event stream to the index; counts what it could not apply.
    ``on_drop(pod, reason)``: called for each message (or, ``unknown_medium``, each
    event) dropped."""

    def __init__(self, pod: str, index: PrefixIndex, on_batch: Callable[[str], None],
                 on_drop: Callable[[str, str], None] | None = None) -> None:
        self.pod = pod
        self.index = index
        self.on_batch = on_batch
        self.on_drop = on_drop
        self.last_seq: int | None = None
        self.batches = 0
        self.errors = 0
        self.gaps = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    def _drop(self, reason: str, detail: str = "", count: int = 1) -> None:
        self.dropped[reason] += count
        if reason != UNKNOWN_MEDIUM:
            self.errors += count
        if self.on_drop is not None:
            for _ in range(count):
                self.on_drop(self.pod, reason)
        log.debug("pod %s: dropped (%s) %s", self.pod, reason, detail)

    def handle(self, frames: list[bytes]) -> None:
        """One message; never raises for a bad one."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._drop(FRAMES, f"{len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.last_seq is not None and seq <= self.last_seq:
            # the publisher restarted (its sequence starts again): so did its cache
            self.index.forget(self.pod)
        elif self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1  # events lost (PUB drops at the high-water mark)
        self.last_seq = seq
        if len(frames[2]) > MAX_BATCH_BYTES:
            self._drop(OVERSIZED, f"{len(frames[2])} bytes")
            return
        try:
            batch = decode_batch(frames[2])
        except EventError as e:
            self._drop(UNDECODABLE, str(e))
            return
        try:
            _applied, unknown = self.index.apply(self.pod, batch)
        except OversizedBatch as e:
            self._drop(OVERSIZED, str(e))
            return
        except EventError as e:
            self._drop(MALFORMED, str(e))
            return
        except Exception as e:  # anything else a hostile batch provokes: still dropped
            log.warning("pod %s: a KV event batch broke the index update: %r", self.pod, e)
            self._drop(MALFORMED, repr(e))
            return
        if unknown:
            self._drop(UNKNOWN_MEDIUM, "events of a medium this router does not index",
                       unknown)
        self.batches += 1
        self.on_batch(self.pod)


SOURCES_PATH = "/kv_event_sources"


def event_endpoints(sources: Any, pod_host: str) -> list[str]:
    """The ZMQ endpoints to subscribe to, from a pod's ``/kv_event_sources`` answer,
    by rank. A wildcard host (``*``, ``0.0.0.0``, ``::``) is the pod's own; ranks
    whose events are off, or not on TCP, are left out; an answer of another shape is
    ValueError."""
    if not isinstance(sources, dict):
        raise ValueError(f"{SOURCES_PATH} answered {type(sources).__name__}, not an object")
    out: list[str] = []

    def rank_order(item: tuple[Any, Any]) -> tuple[int, str]:
        key = str(item[0])
        return (int(key), key) if key.isdigit() else (1 << 30, key)

    for _rank, config in sorted(sources.items(), key=rank_order):
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq":
            continue
        endpoint = config.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            continue  # ipc/inproc are local to the pod
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or int(port) == 0:
            continue  # not bound yet (tcp://*:0 before the publisher started)
        if host in ("*", "0.0.0.0", "[::]", "::", ""):
            host = pod_host
        elif host.lower().startswith("[::ffff:") and "." in host:
            host = host[len("[::ffff:"):-1]  # an IPv4 pod IP, as the launcher binds it
        out.append(f"tcp://{host}:{port}")
    return out


async def subscribe(endpoint: str, feed: EventFeed) -> None:
    """Feed ``endpoint``'s messages to ``feed`` until cancelled (ZMQ reconnects itself)."""
    try:
        import zmq
        import zmq.asyncio
    except ImportError:
        # the operator image without vLLM: approximate routing for this pod
        log.warning("pod %s: pyzmq is not installed; no KV events, approximate mode", feed.pod)
        return
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            feed.handle(frames)
    except asyncio.CancelledError:
        raise
    except Exception:  # a broken socket must not take the router down
        log.exception("pod %s: event subscription %s failed", feed.pod, endpoint)
    finally:
        sock.close(0)
