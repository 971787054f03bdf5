"""The checker of extra arguments against vLLM 0.33.0's ``vllm serve`` parser
(``spillway_engine.vllm_cli``), without vLLM: its verdicts and messages, the
launcher and the spec model refusing with them, and the CRD rule built from the same
table. tests/contract/test_vllm_cli.py holds them against vLLM's real parser."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spillway_engine import vllm_cli
from spillway_engine.launcher.serve import EngineCliError, build_command
from spillway_engine.planner.plan import PlanRequest, make_plan
from spillway_engine.seam import EngineOptions
from spillway_engine.vllm_pins import VLLM_VERSION
from spillway_operator.flow.cel import CEL_RULES
from spillway_operator.flow.spec import EngineSpec
from tests.unit.planner_fixtures import load_model

PLAN = make_plan(load_model("llama-3.2-1b"),
                 PlanRequest(model_name="llama-3.2-1b", cpu_memory_bytes=8 * 2**30,
                             max_model_len=8192))


def test_the_table_is_vllm_0_33_0s_and_package_data():
    table = vllm_cli.load_table()
    assert table["vllm_version"] == VLLM_VERSION
    assert table["prog"] == "vllm serve" and table["allow_abbrev"] is True
    assert vllm_cli.TABLE_FILE.parent.name == "spillway_engine"
    assert vllm_cli.TABLE_FILE.suffix == ".json"
    names = vllm_cli.long_option_names()
    assert len(names) == len(set(names)) > 400
    assert {"max-num-seqs", "no-enforce-eager", "disable-log-stats", "kv-events-config"} <= set(
        names)
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*", n) for n in names)  # safe in CEL literals
    assert vllm_cli.dump_table(table) == vllm_cli.TABLE_FILE.read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--bogus", "1", "--seed", "1"], "unrecognized arguments: --bogus 1"),
    (["stray"], "unrecognized arguments: stray"),
    (["--", "x"], "unrecognized arguments: -- x"),
    (["--"], "unrecognized arguments: --"),  # after the launcher's --port N
    (["--Max-Num-Seqs", "8"], "unrecognized arguments: --Max-Num-Seqs 8"),
    (["--max-num-seqs"], "argument --max-num-seqs: expected one argument"),
    (["--max-num-seqs", "--enforce-eager"], "argument --max-num-seqs: expected one argument"),
    (["--max-num", "8"], "ambiguous option: --max-num could match --max-num-batched-tokens, "),
    (["--enforce-eager=1"], "argument --enforce-eager/--no-enforce-eager: ignored explicit "
                            "argument '1'"),
    (["--max-lora-rank", "3"], "argument --max-lora-rank: invalid choice: 3 (choose from 1, 8"),
    (["--max-lora-rank", "x"], "argument --max-lora-rank: invalid int value: 'x'"),
    (["-q"], "argument --quantization/-q: expected one argument"),
    (["--bogus.key=1k"], 'unrecognized arguments: --bogus {"key": 1000}'),
    (["--kv-events-config.endpoint"],
     "vllm serve fails before parsing its arguments: IndexError: list index out of range"),
    (["--task", "embed"], "unrecognized arguments: --task embed\n\nHint: --task is not"),
    (["--omni"], "--omni flag requires a valid instance of vllm-omni to be installed."),
    (["--help"], "--help: vllm serve prints its help and exits (status 0) instead of serving"),
    (["--config", "x.yaml"], "--config: vllm serve reads the named YAML file"),
    # values of the wrong type, in vLLM's words (its parser exits 2 on them)
    (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
    (["--max_num_seqs=1.5"], "argument --max-num-seqs: invalid int value: '1.5'"),
    (["--max-num-se", "8x"], "argument --max-num-seqs: invalid int value: '8x'"),
    (["--gpu-memory-utilization", "most"],
     "argument --gpu-memory-utilization/--device-memory-utilization: invalid float value: "
     "'most'"),
    (["--max-log-len", "1.5"], "argument --max-log-len: Value 1.5 cannot be converted to "
                               "<class 'int'>."),
    (["--safetensors-prefetch-block-size", "1.5K"],
     "argument --safetensors-prefetch-block-size: Decimals are not allowed with binary "
     "suffixes like K. Did you mean to use 1.5k instead?"),
    (["--kv-offloading-size", "lots"], "argument --kv-offloading-size: Value lots cannot be "
                                       "converted to <class 'float'>."),
])
def test_what_vllms_parser_refuses_is_refused_with_its_message(args, message):
    assert vllm_cli.refusal(args).startswith(message)


@pytest.mark.parametrize("args", [
    [],
    ["--max-num-seqs", "64", "--max_num_batched_tokens=8192"],
    ["--max-num-se", "64"],  # an unambiguous prefix
    ["--enforce-eager", "--no-enforce-eager", "--disable-log-stats"],
    ["--seed", "-1"],
    ["-O3"], ["-O", "2"],
    ["--kv-events-config.endpoint=tcp://*:1", "--kv-events-config.publisher", "zmq"],
    ["--moe-backend", "AUTO"],  # its type lowers the value before the choice
    ["--log-level", "DEBUG"],
    ["--chat-template", "--x y"],  # a value with a space is a value, even with --
    # values as vLLM's types take them
    ["--max-num-seqs", " 8 ", "--seed", "+3", "--max-num-batched-tokens", "1_000"],
    ["--gpu-memory-utilization", "9e-1", "--max-log-len", "None", "--kv-offloading-size", ""],
    ["--safetensors-prefetch-block-size", "1.5k"],
])
def test_what_vllms_parser_takes_passes(args):
    assert vllm_cli.refusal(args) is None


def test_the_launcher_refuses_with_vllms_message():
    """An unknown flag gave pods that exited 2 at start; now the launcher refuses it."""
    with pytest.raises(EngineCliError) as info:
        build_command(PLAN, EngineOptions(model="m", extra_args=("--max-num-seqs", "8", "x")))
    assert str(info.value) == (
        f"extra arguments --max-num-seqs 8 x are refused: vllm serve {VLLM_VERSION} would not "
        "start with them: unrecognized arguments: x"
    )
    with pytest.raises(EngineCliError, match="Hint: --task is not a vllm serve option"):
        build_command(PLAN, EngineOptions(model="m", extra_args=("--task", "embed")))
    with pytest.raises(EngineCliError) as info:  # one line, as every launcher error
        build_command(PLAN, EngineOptions(model="m", extra_args=("--task", "embed")))
    assert "\n" not in str(info.value)


def test_plan_owned_flags_keep_their_own_message():
    with pytest.raises(EngineCliError, match="--block-size is set by"):
        build_command(PLAN, EngineOptions(model="m", extra_args=("--block-size", "32", "x")))
    with pytest.raises(ValidationError, match="--block-size is set by"):
        EngineSpec(extra_args=["--block-size", "32", "x"])


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus-flag", "1"], "unrecognized arguments: --bogus-flag 1"),
    (["--max-num-seqs", "8", "stray"], "unrecognized arguments: stray"),
    (["--max-num-seqs"], "argument --max-num-seqs: expected one argument"),
    (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
])
def test_the_spec_refuses_with_vllms_message(args, message):
    with pytest.raises(ValidationError) as info:
        EngineSpec(extra_args=args)
    assert f"vllm serve {VLLM_VERSION} would not start with them: {message}" in str(info.value)
    EngineSpec(extra_args=["--max-num-seqs", "8"])


# ---------------------------------------------------------------- the CRD rule

TOKENS = st.one_of(
    st.sampled_from(vllm_cli.long_option_names()).flatmap(
        lambda n: st.tuples(st.integers(0, len(n)), st.booleans(), st.sampled_from(
            ["", "=1", ".a=1", "x", "=a b", "+"])).map(
            lambda t: "--" + (n[: len(n) - t[0]] if t[0] < len(n) else "").replace(
                "-", "_" if t[1] else "-") + t[2])),
    st.text(alphabet="-_=.abcdeklmnoprstuvxyz019 ", max_size=16),
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(TOKENS, max_size=4))
def test_an_unknown_option_is_refused_by_vllm_too(tokens):
    """The per-item rule never admits less than vLLM: an unknown long option refuses
    the whole list, unless a dotted argument without '=' took it as its value."""
    dotted = any(t.startswith("-") and "." in t and "=" not in t for t in tokens)
    if any(vllm_cli.unknown_long_flag(t) for t in tokens) and not dotted:
        assert vllm_cli.refusal(tokens) is not None, tokens


@given(TOKENS)
def test_the_prefix_tables_are_the_prefixes(token):
    shared, unique = vllm_cli.prefix_tables()
    name = vllm_cli.option_key(token)[2:]
    in_tables = name in set(shared) or any(
        name[:n] in unique and unique[name[:n]].startswith(name)
        for n in {len(k) for k in unique}
    )
    assert in_tables == (name in vllm_cli.name_prefixes())


def test_the_crd_rule_is_built_from_the_table():
    rule = CEL_RULES["spec.engine.extraArgs[]"][1]["rule"]
    shared, unique = vllm_cli.prefix_tables()
    assert "{" + ",".join(f'"{p}":1' for p in shared) + "}" in rule
    assert json.dumps(unique, separators=(",", ":")) in rule
    assert len(rule) < 40_000  # the CRD stays small
    assert "is not an option of vllm serve" in CEL_RULES["spec.engine.extraArgs[]"][1][
        "messageExpression"]


def test_the_table_types_the_numbers_vllm_converts():
    """Every option the table types can refuse a value, and the plain numeric options
    of vllm serve are among them (--max-num-seqs, --gpu-memory-utilization)."""
    typed = {o["strings"][0]: o["type"] for o in vllm_cli.load_table()["options"]
             if o.get("type")}
    assert typed["--max-num-seqs"] == "int" and typed["--gpu-memory-utilization"] == "float"
    assert sum(t in ("int", "float", "optional_int", "optional_float") for t in
               typed.values()) > 60
    assert set(typed.values()) <= set(vllm_cli.TYPES)


@settings(max_examples=300, deadline=None)
@given(st.integers(-(10**12), 10**12), st.text(max_size=5))
def test_an_int_options_value_is_refused_exactly_when_int_refuses_it(number, junk):
    for value in (str(number), str(number) + junk, junk):
        try:
            int(value)
        except ValueError:
            assert vllm_cli.refusal(["--max-num-seqs", value]) is not None, value
        else:
            assert vllm_cli.refusal(["--max-num-seqs", value]) is None or value.lstrip(
                " ").startswith("-"), value  # a negative reads as an option to argparse


@settings(max_examples=1000, deadline=None)
@given(TOKENS | st.sampled_from(sorted(vllm_cli.int_options())).flatmap(
    lambda n: st.tuples(st.booleans(), st.text(alphabet="aZx19 .-_", max_size=4)).map(
        lambda t: "--" + (n.replace("-", "_") if t[0] else n) + "=" + t[1])))
def test_a_value_the_crd_rule_refuses_vllm_refuses(token):
    """The CRD's value rule (vllm_cli.bad_int_value) never admits less than vLLM: a
    token it refuses is refused by vLLM's parser alone, with argparse's message."""
    if vllm_cli.bad_int_value(token):
        assert "invalid int value" in vllm_cli.refusal([token]), token


def test_the_crd_value_rule_is_built_from_the_table():
    rule = CEL_RULES["spec.engine.extraArgs[]"][2]
    assert '"max-num-seqs":"--max-num-seqs"' in rule["rule"]
    assert '"api-server-count":"--api-server-count/-asc"' in rule["rule"]
    assert "invalid int value" in rule["messageExpression"]
    assert vllm_cli.bad_int_value("--max_num_seqs=abc") and vllm_cli.bad_int_value(
        "--seed=") and not vllm_cli.bad_int_value("--max-num-seqs=8")
    assert not vllm_cli.bad_int_value("--max-num-seqs abc")  # a space: a positional
    assert not vllm_cli.bad_int_value("--max-num-seqs.a=abc")  # a dotted JSON argument
