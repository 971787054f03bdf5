"""Kubernetes resource quantities for byte sizes: parse ``64Gi``/``1.5G``/``1e9``, format back.

Only the forms that make sense for memory are accepted (no ``m`` milli suffix: a
fraction of a byte is never a memory size). Shared by the planner and the operator.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_PATTERN = re.compile(r"^\s*([+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class QuantityError(ValueError):
    """A string that is not a non-negative byte quantity."""


def parse_bytes(value: str | int, *, what: str = "quantity") -> int:
    """Bytes in a Kubernetes quantity (``64Gi``, ``500M``, ``1e9``, ``1073741824``).

    Fractions of a byte round up, as Kubernetes does for memory.
    """
    if isinstance(value, bool):
        raise QuantityError(f"{what}: {value!r} is not a byte quantity")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"{what}: {value} is negative")
        return value
    match = _PATTERN.match(str(value))
    if not match:
        raise QuantityError(
            f"{what}: {value!r} is not a byte quantity (examples: 64Gi, 500M, 1073741824)"
        )
    number, suffix = match.groups()
    if suffix in _BINARY:
        scale = _BINARY[suffix]
    elif suffix in _DECIMAL:
        scale = _DECIMAL[suffix]
    elif suffix == "":
        scale = 1
    else:
        raise QuantityError(
            f"{what}: unknown suffix {suffix!r} in {value!r} "
            "(use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P or E)"
        )
    try:
        exact = Decimal(number) * scale
    except InvalidOperation as exc:  # pragma: no cover - the regex already guards this
        raise QuantityError(f"{what}: {value!r} is not a number") from exc
    whole = int(exact)
    return whole + 1 if exact > whole else whole


def format_bytes(num_bytes: int) -> str:
    """The shortest exact Kubernetes quantity for ``num_bytes`` (``64Gi``, ``1536Mi``, ``1000``)."""
    if num_bytes < 0:
        raise QuantityError(f"{num_bytes} is negative")
    for suffix, scale in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{suffix}"
    return str(num_bytes)


def human_bytes(num_bytes: int) -> str:
    """A rounded size for people (``1.25 GiB``); never for manifests."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
