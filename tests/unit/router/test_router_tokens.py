"""spillway_router.tokens: a request's prompt as the engine will see it (pure)."""

from __future__ import annotations

import pytest

from spillway_engine.word_tokenizer import chat_tokens, tokenize
from spillway_router.tokens import BadRequest, SimulatorTokenizer, prompt_of, text_keys

C, CHAT = "/v1/completions", "/v1/chat/completions"


def test_token_ids_are_used_as_given() -> None:
    p = prompt_of(C, {"prompt": [5, 6, 7], "cache_salt": "s", "user": "u"}, None)
    assert (p.tokens, p.text, p.cache_salt, p.session) == ([5, 6, 7], None, "s", "u")
    assert prompt_of(C, {"prompt": [[1, 2], [3]]}, None).tokens == [1, 2]  # a batch: first


def test_text_without_a_tokenizer_stays_text() -> None:
    assert prompt_of(C, {"prompt": "hello there"}, None).text == "hello there"
    assert prompt_of(C, {"prompt": ["a b", "c"]}, None).text == "a b"
    chat = prompt_of(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, None)
    assert chat.tokens is None and "hi" in (chat.text or "")


def test_the_model_tokenizer_gives_the_engines_tokens() -> None:
    tok = SimulatorTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_of(CHAT, {"messages": msgs}, tok).tokens == chat_tokens(msgs)
    assert prompt_of(C, {"prompt": "hello there"}, tok).tokens == tokenize("hello there")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (C, {}),
        (C, {"prompt": []}),
        (C, {"prompt": [True, 1]}),
        (C, {"prompt": [1.5]}),
        (C, {"prompt": [None]}),
        (C, {"prompt": {"a": 1}}),
        (CHAT, {"messages": []}),
        (CHAT, {"messages": "hi"}),
        (CHAT, {"messages": [1]}),
    ],
)
def test_bad_prompts_are_400(path: str, body: dict) -> None:
    with pytest.raises(BadRequest):
        prompt_of(path, body, None)


def test_text_keys_share_a_prefix_and_skip_the_tail() -> None:
    a = text_keys("x" * 100 + "a" * 30, 64)
    b = text_keys("x" * 100 + "b" * 30, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert text_keys("short", 64) == []
