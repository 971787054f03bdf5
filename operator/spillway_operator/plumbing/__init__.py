"""Talking to the API server: the counted, gated client (kube), the watches and their
cache, leader election and the operator's own metrics. Nothing here knows what an
InferenceDeployment means; of the operator it imports only :mod:`spillway_operator.names`
(tests/unit/tree/test_layers.py)."""
