"""Subscription to one pod's vLLM KV events (ZMQ PUB, frames: topic, seq, msgpack
EventBatch). pyzmq comes with vLLM; it is imported only when a pod publishes.

Where a pod publishes: ``spillway-engine serve`` binds each data-parallel rank's
publisher on the pod's IP at a port the OS picks, and vLLM 0.33 lists the bound
endpoints at ``GET /kv_event_sources`` on the serving port (rank -> its
KVEventsConfig); :func:`event_endpoints` reads that answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .index import EventError, PrefixIndex, decode_batch

log = logging.getLogger("spillway.router.events")


class EventFeed:
    """Applies one pod's event stream to the index; counts what it could not apply."""

    def __init__(self, pod: str, index: PrefixIndex, on_batch: Callable[[str], None]) -> None:
        self.pod = pod
        self.index = index
        self.on_batch = on_batch
        self.last_seq: int | None = None
        self.batches = 0
        self.errors = 0
        self.gaps = 0

    def handle(self, frames: list[bytes]) -> None:
        """One message; never raises for a bad one."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.errors += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.last_seq is not None and seq <= self.last_seq:
            # the publisher restarted (its sequence starts again): so did its cache
            self.index.forget(self.pod)
        elif self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1  # events lost (PUB drops at the high-water mark)
        self.last_seq = seq
        try:
            self.index.apply_batch(self.pod, decode_batch(frames[2]))
        except EventError as e:
            self.errors += 1
            log.debug("pod %s: %s", self.pod, e)
            return
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
