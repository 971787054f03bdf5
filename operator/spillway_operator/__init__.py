"""Spillway's Kubernetes operator (kopf): reconciles InferenceDeployments into GPU pods."""

__version__ = "0.1.0"
