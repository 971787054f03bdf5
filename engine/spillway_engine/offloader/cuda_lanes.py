"""CUDA execution of copy plans: one stream per direction, timed by events, no vLLM.

The worker (:mod:`.worker`) submits every transfer through a :class:`CudaLane` with
vLLM's batched memcpy; the GPU transfer check (``e2e/gpu/transfer_check.py``) runs the
same lanes with ``cuMemcpyBatchAsync`` from cuda-bindings in its place. A *memcpy* is
any ``f(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=...)`` over int64 CPU
tensors that enqueues the copies on the current CUDA stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from spillway_engine.offloader.copy_plan import CopyPlan, copy_pointers

Memcpy = Callable[..., None]


class LaneResult(NamedTuple):
    job_id: int
    num_bytes: int
    seconds: float


@dataclass
class _InFlight:
    job_id: int
    num_bytes: int
    start: Any  # torch.cuda.Event
    end: Any
    # descriptor arrays must outlive the asynchronous copy
    keepalive: tuple[Any, ...] = field(default_factory=tuple)


def batched_copy(
    plan: CopyPlan, gpu_bases: Sequence[int], host_base: int, memcpy: Memcpy
) -> tuple[torch.Tensor, ...]:
    """Enqueue ``plan`` as one batched memcpy; returns the arrays to keep alive."""
    keepalive = tuple(torch.from_numpy(a) for a in copy_pointers(plan, gpu_bases, host_base))
    # host memory is never written by a GPU stream: loads may prefetch it
    memcpy(*keepalive, is_src_access_order_any=not plan.store)
    return keepalive


class CudaLane:
    """One direction's dedicated stream; copies run (and finish) in submission order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pending: deque[_InFlight] = deque()

    def submit(
        self, job_id: int, plan: CopyPlan, copy: Callable[[CopyPlan], tuple[Any, ...] | None]
    ) -> None:
        """Enqueue ``copy(plan)`` (which enqueues on the current stream) on this lane."""
        stream = self.stream
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # Stores read KV the model is still writing; loads must land after pending
        # writes (zeroing) to their blocks: both order after the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        keepalive: tuple[Any, ...] = ()
        with torch.cuda.stream(stream):
            start.record(stream)
            if len(plan):
                keepalive = copy(plan) or ()
            end.record(stream)
        self.pending.append(_InFlight(job_id, plan.num_bytes, start, end, keepalive))

    def finished(self) -> list[LaneResult]:
        out = []
        while self.pending and self.pending[0].end.query():
            job = self.pending.popleft()
            seconds = job.start.elapsed_time(job.end) * 1e-3
            out.append(LaneResult(job.job_id, job.num_bytes, seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for job in self.pending:
            if job.job_id in job_ids:
                job.end.synchronize()

    def drain(self) -> None:
        if self.pending:
            self.pending[-1].end.synchronize()
        self.pending.clear()
