"""Spillway's images, built by tools/images.sh, in real containers."""
