"""What an engine is configured with besides its plan: the latency model and the
scheduler's limits.

Latency model (all in seconds of modelled time; constants in :class:`LatencyModel`)
    step      = (step_overhead_s + max(prefill_s_per_token * prefill_tokens
                 + decode_s_per_seq * decoding_requests, memory_floor_s))
                * (1 + U(-jitter, +jitter))
    host load = bytes_per_rank / pcie_bytes_per_s, serialised on the host-to-device
                link (bytes_per_rank = blocks loaded * page_bytes * layers of the group);
                the request waits for it, other requests keep running
    host store= the same on the device-to-host link; it delays nobody
    TTFT      = first token time - arrival (queueing + loads + prefill steps)
    queue     = first admission - arrival;  ITL = time between a request's tokens
    Defaults approximate an 8B dense model on one H100: 4 ms per step, 60 us per prefill
    token (~16.7k tokens/s), 50 us per decoding sequence, 25 GB/s effective PCIe, 2%
    jitter. A host hit of T tokens therefore costs T * bytes_per_token / 25e9 s instead
    of 60e-6 * T s of prefill (~23x cheaper at Llama-3.1-8B's 131 kB/token).
    Transfers in metrics are summed over the plan's copies (TP workers), as vLLM does:
    bytes x copies, seconds x copies. The constants are not scaled by model size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LatencyModel:
    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 60e-6
    decode_s_per_seq: float = 50e-6
    pcie_bytes_per_s: float = 25e9
    jitter: float = 0.02
    #: A step never computes faster than the GPU reads the weights once (a roofline's
    #: memory side); 0 keeps the additive model above.
    memory_floor_s: float = 0.0

    @classmethod
    def emulating(cls, gpu: Any, cost: Any, speed: float, overhead_s: float = 0.0,
                  jitter: float = 0.0) -> LatencyModel:
        """The emulated GPU worker's step times (``spillway_engine.emulator.latency``:
        the larger of compute and one weight read, times ``speed``), plus the engine's
        own CPU time per step (``overhead_s``, measured: the emulator does not sleep
        it out). KV reads are left out (tiny next to the weights of the modelled size)."""
        from spillway_engine.emulator.latency import memory_s, prefill_tokens_per_s, transfer_s

        per_token = speed / prefill_tokens_per_s(gpu, cost)
        link = 1.0 / (transfer_s(1.0, gpu) * speed) if speed > 0 else float("inf")
        return cls(step_overhead_s=overhead_s, prefill_s_per_token=per_token,
                   decode_s_per_seq=per_token, pcie_bytes_per_s=link, jitter=jitter,
                   memory_floor_s=memory_s(gpu, cost) * speed)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: None: the plan's max_model_len
    max_model_len: int | None = None
