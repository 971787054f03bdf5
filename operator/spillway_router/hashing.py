"""vLLM 0.33's prefix-cache block hashes, computed without importing vLLM.

The engine hashes a request's tokens in blocks of ``hash_block_size`` tokens (the
plan's ``tokens_per_hash``), each hash chained on its parent:
``hash_fn((parent, tuple(block_tokens), extra_keys))``, the first parent being
``NONE_HASH = hash_fn(seed)``. The seed is ``PYTHONHASHSEED`` when set, else the fixed
``"vllm-none-hash"`` for the cryptographic algorithms (sha256, sha256_cbor); the
xxhash algorithms take a random per-process seed unless PYTHONHASHSEED is set, so the
router refuses them without an explicit seed. A group whose blocks span k hash units
is keyed by every k-th hash of the same chain.

KV events carry either the raw digest (bytes) or, with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its low 64 bits as an int; :func:`external_key`
maps both to the same int, which is what the index stores.
tests/contract/test_router_engines.py checks all of this against vLLM's own code.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_MASK64 = (1 << 64) - 1


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; only needed for the *_cbor algorithms

    return cbor2.dumps(obj, canonical=True)


def _xxh(data: bytes) -> bytes:
    import xxhash  # optional, as in vLLM

    return xxhash.xxh3_128_digest(data)


def hash_function(name: str) -> Callable[[Any], bytes]:
    """The digest vLLM's ``--prefix-caching-hash-algo NAME`` uses."""
    if name == "sha256":
        return lambda obj: hashlib.sha256(_pickled(obj)).digest()
    if name == "sha256_cbor":
        return lambda obj: hashlib.sha256(_cbor(obj)).digest()
    if name == "xxhash":
        return lambda obj: _xxh(_pickled(obj))
    if name == "xxhash_cbor":
        return lambda obj: _xxh(_cbor(obj))
    raise ValueError(f"unknown prefix-caching hash algorithm {name!r} (one of {ALGORITHMS})")


def external_key(block_hash: bytes | int) -> int:
    """The index key of a block hash as an event carries it (bytes or int)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


@dataclass(frozen=True)
class HashConfig:
    """What must match the engine: algorithm, seed and hash unit in tokens."""

    block_size: int
    algorithm: str = "sha256"
    seed: str | None = None  # PYTHONHASHSEED of the engine, if it sets one

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"hash block size must be positive, got {self.block_size}")
        hash_function(self.algorithm)  # validates the name
        if self.algorithm.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"{self.algorithm} uses a random per-process seed in vLLM unless "
                "PYTHONHASHSEED is set; give the engines' seed (or use sha256)"
            )


class BlockHasher:
    """Chained block hashes of token sequences, as the engine computes them."""

    def __init__(self, config: HashConfig) -> None:
        self.config = config
        self._fn = hash_function(config.algorithm)
        self.none_hash = self._fn(config.seed if config.seed is not None else DEFAULT_SEED)

    def digests(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Raw digests of every full block of ``tokens`` (a partial tail is not hashed)."""
        size = self.config.block_size
        parent = self.none_hash
        out: list[bytes] = []
        for start in range(0, len(tokens) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if (start == 0 and cache_salt) else None
            parent = self._fn((parent, tuple(tokens[start : start + size]), extra))
            out.append(parent)
        return out

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Index keys (:func:`external_key`) of every full block of ``tokens``."""
        return [external_key(d) for d in self.digests(tokens, cache_salt)]
