"""Spillway's patched chunked KV offloader, a vLLM 0.33 connector plugin.

vLLM loads it by ``kv_connector="SpillwayOffloadingConnector"`` (registered by the
``spillway`` general plugin) or by ``kv_connector_module_path="spillway_engine.offloader"``.
The connector is imported lazily so the layout types stay importable without vLLM.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.vllm_pins import SPILLWAY_CONNECTOR as CONNECTOR_NAME


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        from spillway_engine.offloader.connector import SpillwayOffloadingConnector

        return SpillwayOffloadingConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_connector() -> None:
    """Make the connector known to vLLM by name (idempotent, every process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
    if "SpillwayHostSpec" not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(
            "SpillwayHostSpec", "spillway_engine.offloader.spec", "SpillwayHostSpec"
        )
