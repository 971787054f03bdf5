"""Reading a model's config.json: hostile or broken text gets one plain error, never a crash."""

from __future__ import annotations

import json

import pytest

from spillway_engine.planner.model_config import (
    MAX_CONFIG_DEPTH,
    ModelConfigSourceError,
    _depth,
    parse_config_text,
)


def test_deeply_nested_brackets_are_refused_without_recursion_error():
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ModelConfigSourceError, match="nests arrays/objects more than 64"):
        parse_config_text(text, "ConfigMap m key config.json")


def test_depth_counts_brackets_outside_strings_only():
    assert _depth(json.dumps({"a": "[[[{{", "b": [[1]]})) == 3
    assert _depth(json.dumps({"a": 'x"[[', "b": 1})) == 1
    assert _depth(json.dumps({"a": "back\\slash[", "b": [1]})) == 2


def test_nesting_at_the_limit_still_parses():
    nested: dict = {"architectures": ["LlamaForCausalLM"]}
    inner = nested
    for _ in range(MAX_CONFIG_DEPTH - 2):
        inner["x"] = {}
        inner = inner["x"]
    assert parse_config_text(json.dumps(nested), "c")["architectures"] == ["LlamaForCausalLM"]


def test_oversized_text_is_refused():
    with pytest.raises(ModelConfigSourceError, match=r"more than a config\.json can be"):
        parse_config_text('{"a": "' + "x" * (5 * 2**20) + '"}', "c")


@pytest.mark.parametrize(
    ("text", "message"),
    [("{", "not valid JSON"), ("[1, 2]", "must hold a JSON object"), ("", "not valid JSON")],
)
def test_broken_text_gets_one_line(text, message):
    with pytest.raises(ModelConfigSourceError, match=message) as err:
        parse_config_text(text, "c")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), 1e308, -2.0, 0.5e4, True])
def test_absurd_rope_factor_is_refused_by_name(factor):
    from spillway_engine.planner.families import model_shape
    from spillway_engine.planner.shape import ModelConfigError

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 256,
        "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "linear", "factor": factor},
    }
    with pytest.raises(ModelConfigError, match="rope factor"):
        model_shape(config)
