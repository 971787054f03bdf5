"""Spillway on kind: the shell scripts a user runs, and cluster.py, the harness the
demo and tests/kind drive them with."""
