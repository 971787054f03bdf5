"""How long a step would take on the planned GPU: a roofline estimate, pure functions.

The emulated worker answers a step in microseconds; a real H100/H200 spends
milliseconds. This module says how many, so the worker can sleep that long and TTFT,
throughput and queueing in the real vLLM engine look like a GPU pod's. It imports
nothing from vLLM or torch.

The model is deliberately coarse (one roofline per step):

* compute: ``2 x parameters`` FLOPs per scheduled token (prefill or decode), at the
  GPU's dense BF16 peak times an achieved fraction (MFU);
* memory: every step reads the weights once plus the KV bytes of the scheduled
  requests' contexts, at HBM bandwidth times an achieved fraction;
* a step takes the larger of the two. Prefill-heavy steps come out compute-bound
  (time ~ tokens / prefill tokens/s), small decode batches memory-bound (time ~
  weights / bandwidth, nearly flat in batch size).

Not modelled: attention FLOPs (quadratic in context), MoE routing (a MoE model's
total parameters overstate its per-token compute), kernel launch overheads, tensor
parallel communication. Every figure below is an ESTIMATE; the sources are the
vendors' datasheets and the PCIe specification, the efficiencies are round guesses
of what vLLM achieves, not measurements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from spillway_engine.emulator import ENV_MODEL_PARAMS, ENV_SPEED

TERA = 1e12
GIGA = 1e9

#: Documented default model size for callers with nothing better: an 8B dense model
#: (Llama-3.1-8B class) in bfloat16.
DEFAULT_MODEL_PARAMS = 8e9
DEFAULT_BYTES_PER_PARAM = 2.0

# PCIe 5.0 x16: 32 GT/s per lane x 16 lanes x 128b/130b encoding / 8 bits = 63.0 GB/s
# per direction, theoretical (PCI-SIG, PCI Express Base Specification 5.0). H100 SXM
# and H200 SXM both attach to the host with PCIe Gen5 x16 (datasheets: "PCIe Gen5:
# 128 GB/s", i.e. both directions).
PCIE_GEN5_X16_BYTES_PER_S = 32 * 16 * (128 / 130) / 8 * GIGA


@dataclass(frozen=True)
class GpuProfile:
    """Peak figures of one GPU and the fraction of each a serving engine achieves."""

    name: str
    bf16_flops: float  # dense (no sparsity) BF16 tensor-core peak, FLOP/s
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # host <-> GPU, per direction
    # Estimates, not measurements: prefill GEMMs in vLLM reach roughly half of peak,
    # decode streams weights at most of HBM bandwidth, pinned-memory copies reach
    # most of the PCIe link (about 50 GB/s of 63).
    mfu: float = 0.45
    hbm_efficiency: float = 0.8
    link_efficiency: float = 0.8


GPU_PROFILES: dict[str, GpuProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 1,979 TFLOPS *with
    # sparsity* (so 989.5 dense), GPU memory bandwidth 3.35 TB/s. The planner's "h100"
    # is the 80GB HBM3 (SXM) part; an H100 PCIe (756 TFLOPS, 2.0 TB/s) is slower.
    "h100": GpuProfile("h100", 989.5 * TERA, 3.35 * TERA, PCIE_GEN5_X16_BYTES_PER_S),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979 TFLOPS with
    # sparsity (the same Hopper compute as H100), memory bandwidth 4.8 TB/s (HBM3e).
    "h200": GpuProfile("h200", 989.5 * TERA, 4.8 * TERA, PCIE_GEN5_X16_BYTES_PER_S),
}
DEFAULT_GPU = "h100"


def gpu_profile(name: str | None) -> GpuProfile:
    """The profile for the plan's ``gpu.name``; other GPUs time as an H100 (the
    caller logs that), since a wrong-but-stated estimate beats none."""
    return GPU_PROFILES.get((name or DEFAULT_GPU).lower(), GPU_PROFILES[DEFAULT_GPU])


@dataclass(frozen=True)
class ModelCost:
    """What one GPU of the engine computes and reads per step (its tensor-parallel share)."""

    params: float = DEFAULT_MODEL_PARAMS
    weight_bytes: float = DEFAULT_MODEL_PARAMS * DEFAULT_BYTES_PER_PARAM

    @classmethod
    def of(cls, params: float, bytes_per_param: float = DEFAULT_BYTES_PER_PARAM) -> ModelCost:
        return cls(float(params), float(params) * bytes_per_param)


def prefill_tokens_per_s(gpu: GpuProfile, model: ModelCost) -> float:
    """Compute-bound token rate: achieved FLOP/s over ``2 x params`` FLOPs per token."""
    return gpu.bf16_flops * gpu.mfu / (2.0 * model.params)


def prefill_s(tokens: int, gpu: GpuProfile, model: ModelCost) -> float:
    """Compute time of ``tokens`` prompt tokens (the compute side of the roofline)."""
    return tokens / prefill_tokens_per_s(gpu, model)


def memory_s(gpu: GpuProfile, model: ModelCost, kv_bytes_read: float = 0.0) -> float:
    """One pass over the weights plus the KV bytes the step's attention reads."""
    return (model.weight_bytes + kv_bytes_read) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)


def step_s(tokens: int, gpu: GpuProfile, model: ModelCost, kv_bytes_read: float = 0.0) -> float:
    """One engine step of ``tokens`` scheduled tokens (prefill chunks and decodes
    together, as vLLM batches them): the larger of compute and memory time."""
    if tokens <= 0:
        return 0.0
    return max(prefill_s(tokens, gpu, model), memory_s(gpu, model, kv_bytes_read))


def decode_step_s(
    batch: int, gpu: GpuProfile, model: ModelCost, kv_bytes_read: float = 0.0
) -> float:
    """A pure decode step: one token for each of ``batch`` sequences."""
    return step_s(batch, gpu, model, kv_bytes_read)


def transfer_s(nbytes: float, gpu: GpuProfile) -> float:
    """Host <-> GPU copy time of ``nbytes`` in one direction."""
    return nbytes / (gpu.host_link_bytes_per_s * gpu.link_efficiency)


def parse_speed(text: str | None) -> float:
    """The time factor from ``SPILLWAY_EMULATE_SPEED``: unset/empty is 0 (no sleeping,
    the emulator's original behaviour), otherwise a finite number >= 0."""
    if text is None or not text.strip():
        return 0.0
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{ENV_SPEED} must be a number >= 0, got {text!r}")
    return value


def speed_from_env(env: Mapping[str, str]) -> float:
    return parse_speed(env.get(ENV_SPEED))


def parse_params(text: str | None) -> float | None:
    """``SPILLWAY_EMULATE_MODEL_PARAMS`` (e.g. ``8e9``), or None when unset."""
    if text is None or not text.strip():
        return None
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{ENV_MODEL_PARAMS} must be a number > 0, got {text!r}")
    return value


def sleep_for(modelled_s: float, factor: float, elapsed_s: float = 0.0) -> float:
    """How long to sleep so a step lasts ``modelled_s x factor``: the emulator's own
    work (``elapsed_s``) already counts towards it. Never sleeps at factor 0."""
    if factor <= 0:
        return 0.0
    return max(0.0, modelled_s * factor - elapsed_s)
