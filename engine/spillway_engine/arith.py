"""Integer helpers every size formula uses (bytes, blocks, chunks): one definition each."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without floats."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return cdiv(value, multiple) * multiple
