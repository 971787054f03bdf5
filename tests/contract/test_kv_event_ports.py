"""vLLM 0.33.0's own ZmqEventPublisher on the endpoint the launcher gives it
(spillway_engine.launcher.kv_events): the pod's IPv4 address in its IPv4-mapped form is
bound (not connected to), on the declared base port plus the data-parallel rank, under
llm-d's topic; the router's subscription reads it from the pod IP and port alone."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from spillway_engine.launcher.kv_events import check_ports_free, endpoint_for, topic_for
from spillway_router.events import EventFeed, subscribe
from spillway_router.index import GPU, PrefixIndex


def _free_pair() -> int:
    """A base port whose next port is free too (rank 1 publishes there)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base < 65535:
            try:
                check_ports_free("127.0.0.1", [base, base + 1])
                return base
            except Exception:  # taken: try another
                continue
    raise AssertionError("no two free ports in a row")


def test_vllms_publisher_binds_the_pod_ip_on_the_declared_port_of_its_rank() -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    base = _free_pair()
    topic = topic_for("127.0.0.1", 8000, "tiny")
    pub = ZmqEventPublisher(1, endpoint=endpoint_for("127.0.0.1", base), topic=topic)
    try:
        # bound, not connected: the port is held on the pod's address
        assert pub.get_publisher_config().endpoint == f"tcp://[::ffff:127.0.0.1]:{base + 1}"
        with pytest.raises(Exception, match=str(base + 1)):
            check_ports_free("127.0.0.1", [base + 1])

        async def run() -> tuple[PrefixIndex, EventFeed]:
            import zmq
            import zmq.asyncio

            index = PrefixIndex()
            feed = EventFeed("pod", index, lambda _pod: None)
            task = asyncio.create_task(subscribe(f"tcp://127.0.0.1:{base + 1}", feed))
            # and a subscriber filtering on llm-d's topic prefix receives the pod's topic
            ctx = zmq.asyncio.Context.instance()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            sub.connect(f"tcp://127.0.0.1:{base + 1}")
            try:
                stored = BlockStored(block_hashes=[b"\x00" * 31 + b"\x09"],
                                     parent_block_hash=None, token_ids=[1] * 16,
                                     block_size=16, lora_id=None, medium=GPU, lora_name=None)
                for _ in range(200):
                    pub.publish(KVEventBatch(ts=time.time(), events=[stored]))
                    await asyncio.sleep(0.05)
                    if feed.batches and await sub.poll(10):
                        break
                frames = await sub.recv_multipart()
                assert frames[0].decode() == "kv@127.0.0.1:8000@tiny"
                return index, feed
            finally:
                task.cancel()
                sub.close(0)

        index, feed = asyncio.run(run())
        assert feed.errors == 0 and index.size("pod") == 1
    finally:
        pub.shutdown()
