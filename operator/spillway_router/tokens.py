"""A request's prompt as the engine will see it: token ids, or failing that text.

Block hashes need the engine's exact tokens: a prompt given as token ids is used as
is; text and chat go through the model's tokenizer and chat template when the router
has one (transformers, imported only then). Without one the router still routes text
by its own text-block keys (approximate mode only: no engine publishes those).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class BadRequest(ValueError):
    """The client's request is wrong (HTTP 400)."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: list[Any]) -> list[int]: ...


@dataclass(frozen=True)
class Prompt:
    tokens: list[int] | None  # the engine's token ids, when known
    text: str | None  # otherwise the text the engine will tokenize
    cache_salt: str | None = None
    session: str | None = None


def _is_token_list(value: Any) -> bool:
    # type() is, not isinstance: bools are not token ids (and this is the hot path)
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def prompt_of(path: str, body: Mapping[str, Any], tokenizer: Tokenizer | None) -> Prompt:
    """The prompt of an OpenAI completions/chat body. Raises :class:`BadRequest`."""
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    session = body.get("user")
    session = session if isinstance(session, str) and session else None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array")
        if not all(isinstance(m, Mapping) for m in messages):
            raise BadRequest("each message must be an object")
        if tokenizer is not None:
            try:
                return Prompt(tokenizer.chat(messages), None, salt, session)
            except Exception:  # a template error: the engine will answer it
                pass
        return Prompt(None, _chat_text(messages), salt, session)
    prompt = body.get("prompt")
    if _is_token_list(prompt):
        return Prompt(prompt, None, salt, session)
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]  # a batch routes with its first prompt
        if _is_token_list(prompt):
            return Prompt(prompt, None, salt, session)
    if isinstance(prompt, str):
        if tokenizer is not None:
            return Prompt(tokenizer.encode(prompt), None, salt, session)
        return Prompt(None, prompt, salt, session)
    raise BadRequest("'prompt' must be a string, an array of token ids, or an array of those")


def _chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<{m.get('role')}>{content if content is not None else ''}")
    return "\n".join(parts)


def text_keys(text: str, chars_per_block: int) -> list[int]:
    """Chained keys of whole ``chars_per_block`` slices of ``text`` (approximate mode)."""
    data = text.encode("utf-8", "surrogatepass")
    parent = b"spillway-text"
    out = []
    for start in range(0, len(data) - chars_per_block + 1, chars_per_block):
        parent = hashlib.sha256(parent + data[start : start + chars_per_block]).digest()
        out.append(int.from_bytes(parent[:8], "big"))
    return out


class HFTokenizer:
    """The model's own tokenizer and chat template (transformers, loaded lazily)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def chat(self, messages: list[Any]) -> list[int]:
        # vLLM renders the template to text, then tokenizes without special tokens
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))


class SimulatorTokenizer:
    """The engine simulator's tokenizer (for the demo and the bench)."""

    def __init__(self) -> None:
        from spillway_engine.word_tokenizer import chat_tokens, tokenize

        self._encode: Callable[[str], list[int]] = tokenize
        self._chat: Callable[[list[Any]], list[int]] = chat_tokens

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def chat(self, messages: list[Any]) -> list[int]:
        return list(self._chat(messages))


def load_tokenizer(spec: str) -> Tokenizer:
    """``simulator`` or a path/model id for transformers."""
    if spec == "simulator":
        return SimulatorTokenizer()
    return HFTokenizer(spec)
