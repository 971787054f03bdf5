"""The vLLM release Spillway is pinned to and the connector names it passes to vLLM.

The one definition of each: the planner writes them into plans, the launcher and the
start-up check compare against them, the offloader registers under them, and the
tests and the GPU check import them. Pure constants, importable without vLLM.
"""

from __future__ import annotations

#: The vLLM release whose geometry the planner mirrors and whose plugin API we target.
VLLM_VERSION = "0.33.0"

#: vLLM's own offloading connector (``kv_connector`` of an ``upstream`` plan).
UPSTREAM_CONNECTOR = "OffloadingConnector"
#: Spillway's connector, registered with vLLM under this name.
SPILLWAY_CONNECTOR = "SpillwayOffloadingConnector"
#: The module vLLM loads Spillway's connector from (``kv_connector_module_path``).
SPILLWAY_CONNECTOR_MODULE = "spillway_engine.offloader"
