"""Spillway's engine side: KV geometry planner, vLLM launcher, offloader plugin, simulator."""

from spillway_engine.vllm_pins import VLLM_VERSION

__version__ = "0.1.0"

__all__ = ["VLLM_VERSION", "__version__"]
