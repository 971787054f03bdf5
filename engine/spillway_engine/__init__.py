"""Spillway's engine side: KV geometry planner, vLLM launcher, offloader plugin, simulator."""

__version__ = "0.1.0"

# The vLLM release whose geometry the planner mirrors and whose plugin API we target.
VLLM_VERSION = "0.33.0"
