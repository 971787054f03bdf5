"""A deterministic stand-in tokenizer: equal text gives equal tokens, shared prefixes share.

The engine simulator serves with it, and spillway-router's ``--tokenizer simulator`` mode
and ``spillway loadgen`` tokenize as the simulator does with it, so it sits on the
engine's base floor rather than inside the simulator.

Each whitespace-separated word maps to ``16 + crc32(word) % (VOCAB_SIZE - 16)``; ids
below 16 are reserved for chat-template markers. A chat is rendered as
``<role> words... <eot>`` per message followed by ``<assistant>`` (the generation
prompt), so a conversation that grows by whole messages keeps its earlier tokens as an
exact prefix — the property prefix caching needs. CRC-32 (not Python's ``hash``) keeps
ids stable across processes and runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

VOCAB_SIZE = 32000
RESERVED = 16
EOT = 5
ROLE_TOKENS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 6}
OTHER_ROLE = 7


@lru_cache(maxsize=1 << 17)
def word_id(word: str) -> int:
    return RESERVED + zlib.crc32(word.encode("utf-8")) % (VOCAB_SIZE - RESERVED)


@lru_cache(maxsize=1 << 14)
def _tokenize_cached(text: str) -> tuple[int, ...]:
    return tuple(word_id(w) for w in text.split())


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` (one per whitespace-separated word)."""
    return list(_tokenize_cached(text))


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    raise ValueError("message content must be a string or a list of text parts")


def chat_tokens(messages: Iterable[Mapping[str, Any]]) -> list[int]:
    """Token ids of a chat: each message as role marker + words + end marker, then the
    assistant marker that asks for the reply."""
    out: list[int] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError("each message needs a string 'role'")
        out.append(ROLE_TOKENS.get(role, OTHER_ROLE))
        out.extend(_tokenize_cached(_content_text(message.get("content"))))
        out.append(EOT)
    out.append(ROLE_TOKENS["assistant"])
    return out


def detokenize(ids: Iterable[int]) -> str:
    """Readable text for generated ids (``w<id>`` words; not the inverse of tokenize)."""
    return " ".join(f"w{i}" for i in ids)
