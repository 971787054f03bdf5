"""The committed ``vllm serve`` argument table and its checker against vLLM 0.33.0's
real parser (``spillway_engine.vllm_cli``).

(a) the table equals what vLLM's parser holds, so it cannot drift; (b) random extra
argument lists, placed where the launcher places them (``build_command``), get the
same verdict from vLLM's parser and from the checker, and the same message when
refused. The checker checks values of the types it reproduces (int, float, their
optional forms, choices) with vLLM's message; a list whose first problem for vLLM is a
value of another type (JSON of a config class) is out of its scope and discarded
(hypothesis ``reject``); the generator gives such options values of their own type, so
few are.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections import Counter
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from spillway_engine import vllm_cli
from spillway_engine.launcher import serve
from spillway_engine.launcher.serve import EngineCliError
from spillway_engine.planner.plan import PlanRequest, make_plan
from spillway_engine.seam import EngineOptions, refused_flag
from spillway_engine.vllm_pins import VLLM_VERSION

from .conftest import load_model

GIB = 2**30
PLAN = make_plan(
    load_model("llama-3.2-1b"),
    PlanRequest(model_name="llama-3.2-1b", cpu_memory_bytes=8 * GIB, max_model_len=8192),
)
OPTIONS = dict(model="org/model", served_model_name="served", eviction_policy="lru")
TABLE = vllm_cli.load_table()
_ENTRIES = {string: o for o in TABLE["options"] for string in o["strings"]}


@pytest.fixture(scope="module")
def vllm_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    return vllm_cli.vllm_serve_parsers()


# ------------------------------------------------------------------ (a) the table


def test_committed_table_is_vllms_parser(vllm_parsers):
    assert TABLE["vllm_version"] == VLLM_VERSION
    assert vllm_cli.TABLE_FILE.read_text() == vllm_cli.dump_table(vllm_cli.build_table()), (
        f"run {vllm_cli.WRITE_COMMAND}"
    )
    _, parser = vllm_parsers
    assert [s for o in TABLE["options"] for s in o["strings"]] == list(
        parser._option_string_actions
    )


VALUES = st.one_of(
    st.sampled_from(["x", "None", "", "A-B", "-1", "0", "1.5", "1e9", "-inf", "nan", "1k",
                     "0x1f", "1_0", " 7 ", "\u0663", "+3", "--"]),
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True).map(str),
    st.text(max_size=6),
)


def test_every_type_the_checker_applies_is_the_options_own(vllm_parsers):
    """Options with a type in the table (with choices, or a type that refuses values:
    int, float, ...): the checker converts values as vLLM's type does, and refuses with
    argparse's own message, over generated values."""
    _, parser = vllm_parsers
    typed = [o for o in TABLE["options"] if "type" in o]
    assert sum("choices" not in o for o in typed) > 50  # numbers' types are checked

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.sampled_from(typed), VALUES)
    def check(o, value):
        action = parser._option_string_actions[o["strings"][0]]
        mine = vllm_cli.TYPES[o["type"]] if o["type"] else None
        assert vllm_cli._outcome(mine, value) == vllm_cli._outcome(action.type, value), (
            o["strings"], value)

    check()
    for o in typed:
        action = parser._option_string_actions[o["strings"][0]]
        mine = vllm_cli.TYPES[o["type"]] if o["type"] else None
        for value in [*(str(c) for c in action.choices or ()), "x", "None", "", "A-B", "-1"]:
            assert vllm_cli._outcome(mine, value) == vllm_cli._outcome(action.type, value), (
                o["strings"], value)


# -------------------------------------------------------------- vLLM's verdict


class _VllmRefused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _OutOfScope(Exception):
    """vLLM refused a value's type (or --lora-modules' format): not the checker's."""


def _raise(self: argparse.ArgumentParser, message: str) -> None:
    raise _VllmRefused(message)


def vllm_verdict(parsers, argv: list[str]) -> str | None:
    """What vLLM's real parser says of ``vllm <argv>``: None (parsed), its message,
    the help marker, or a crash message; raises _OutOfScope."""
    top, parser = parsers
    real_get_value = argparse.ArgumentParser._get_value

    def get_value(action: argparse.Action, arg_string: str) -> Any:
        try:
            return real_get_value(parser, action, arg_string)
        except argparse.ArgumentError:
            if action.choices is None and "type" not in _ENTRIES[action.option_strings[0]]:
                raise _OutOfScope() from None
            raise

    out = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "error", _raise),
        mock.patch.object(parser, "_get_value", get_value),
        contextlib.redirect_stdout(out),
    ):
        try:
            top.parse_args(argv)
        except _VllmRefused as e:
            if "--lora-modules" in e.message and e.message.startswith("Invalid"):
                raise _OutOfScope() from None
            return e.message
        except SystemExit as e:
            assert e.code == 0
            return "exits"
        except (IndexError, ValueError) as e:
            return vllm_cli.CRASH_MESSAGE.format(kind=type(e).__name__, error=e)
    return None


def launcher_argv(extra: list[str]) -> list[str]:
    """The launcher's ``vllm serve`` command for ``extra``, its own check turned off."""
    with mock.patch.object(vllm_cli, "refusal", lambda args: None):
        cmd, _ = serve.build_command(PLAN, EngineOptions(**OPTIONS, extra_args=tuple(extra)))
    assert cmd[0] == "vllm" and cmd[len(cmd) - len(extra):] == extra  # the extras last
    return cmd[1:]


def same_verdict(parsers, extra: list[str]) -> str | None:
    argv = launcher_argv(extra)
    theirs = vllm_verdict(parsers, argv)
    mine = vllm_cli.refusal(extra)
    if theirs == "exits":
        assert mine is not None and "prints its help" in mine, (extra, mine)
    else:
        assert mine == theirs, (extra, argv)
    if mine is None:
        serve.build_command(PLAN, EngineOptions(**OPTIONS, extra_args=tuple(extra)))
    else:
        with pytest.raises(EngineCliError) as info:
            serve.build_command(PLAN, EngineOptions(**OPTIONS, extra_args=tuple(extra)))
        assert vllm_cli.one_line(mine) in str(info.value)
    return mine


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--max-num-seqs", "64"],
        ["--max-num-seqs=64", "--enforce-eager", "--no-enforce-eager"],
        ["--max_num_seqs", "64"],
        ["--max-num-seq", "64"],  # a prefix
        ["--max-num", "64"],  # ambiguous
        ["--Max-Num-Seqs", "64"],  # case matters
        ["--bogus"],
        ["--bogus", "1", "--seed", "1"],
        ["stray"],
        ["--", "x"],
        ["--"],
        ["--seed"],
        ["--seed", "--enforce-eager"],
        ["--seed", "-1"],
        ["-0.5"],  # a token with '-' and '.' is a dotted argument to vLLM
        ["--enforce-eager=yes"],
        ["--log-level", "loud"],
        ["--max-lora-rank", "3"],
        ["--max-lora-rank", "x"],
        ["--moe-backend", "AUTO"],
        ["-O3"],
        ["-O"],
        ["-O", "2"],
        ["-q"],
        ["-x"],
        ["--kv-events-config.endpoint=tcp://*:9", "--kv-events-config.publisher", "zmq"],
        ["--kv-events-config.endpoint"],
        ["--kv-events-config.endpoint", "--bogus"],
        ["--enforce-eager.x=1"],
        ["--bogus.x=1k"],
        ["--task", "embed"],
        ["--task=embed", "--bogus"],
        ["--=x"],
        ["--help"],
        ["-h"],
        ["--help=ModelConfig"],
    ],
    ids=repr,
)
def test_examples_agree_with_vllm(vllm_parsers, extra):
    same_verdict(vllm_parsers, extra)


# ------------------------------------------------------ (b) the differential test

_SKIP = {"--lora-modules", "--config", "-h", "--help"}


def _valid_values(parser: argparse.ArgumentParser) -> dict[str, str]:
    """For each option that takes values: one value its own type and choices accept."""
    values = {}
    for o in TABLE["options"]:
        if o["nargs"] == 0:
            continue
        action = parser._option_string_actions[o["strings"][0]]
        choices = [str(c) for c in action.choices or () if c is not None]
        for candidate in [*choices, "1", "0.5", "x", "{}", "true", "auto", "a=b"]:
            try:
                parser._check_value(action, parser._get_value(action, candidate))
            except (argparse.ArgumentError, TypeError, ValueError):
                continue
            values[o["strings"][0]] = candidate
            break
    return values


def _flags() -> list[dict[str, Any]]:
    return [
        o for o in TABLE["options"]
        if o["strings"][0] not in _SKIP
        and not any(refused_flag(s) for s in o["strings"] if s.startswith("--"))
    ]


JUNK_VALUES = ["-1", "-1e3", "x", "", "a b", "--", "-x", "1k", "a.b", "1.5", "None", "nan"]
LOOSE = [
    "--bogus", "--max-num-seqz", "--enable-bogus", "--no-bogus", "--no-max-num-seqs",
    "--x_y", "--task", "--task=embed", "x", "8", "a.b", "a b", "", "-1", "-0.5", "-1e3",
    "-q", "-n", "-r", "-O3", "-O", "3", "-Odecode", "-O=2", "-x", "-", "-ep", "-qawq", "--",
    "--kv-events-config.endpoint=tcp://*:1", "--kv-events-config.publisher", "zmq",
    "--kv_events_config.enable_kv_cache_events=true", "--compilation-config.mode=3",
    "--compilation-config.custom_ops+=a,b", "--enforce-eager.x=1", "--bogus.k=v",
    "--enable-log-requests=1", "--seed=", "--=x", "---x", "-h", "--help",
]


@st.composite
def _option(draw: Any, flags: list[dict[str, Any]], values: dict[str, str]) -> list[str]:
    o = draw(st.sampled_from(flags))
    flag = draw(st.sampled_from([s for s in o["strings"] if s.startswith("--")]
                                or o["strings"]))
    spelling = draw(st.sampled_from(["as is"] * 6 + ["under", "upper", "cut", "no"]))
    if flag.startswith("--"):
        if spelling == "under":
            flag = "--" + flag[2:].replace("-", "_")
        elif spelling == "upper":
            flag = flag.upper()
        elif spelling == "cut":
            flag = flag[: draw(st.integers(3, max(3, len(flag) - 1)))]
        elif spelling == "no":
            flag = "--no-" + flag[2:]
    value = values.get(o["strings"][0], "x")

    def a_value() -> str:
        return draw(st.sampled_from([value] * 4 + JUNK_VALUES))

    nargs = o["nargs"]
    count = {None: 1, "?": draw(st.integers(0, 1)), "+": draw(st.integers(1, 3)), 0: 0}[nargs]
    if draw(st.integers(0, 9)) == 0:
        count = draw(st.integers(0, 2))  # a value missing or one too many
    if count and nargs in (None, "?") and draw(st.booleans()):
        return [f"{flag}={a_value()}"]
    if nargs == 0 and draw(st.integers(0, 9)) == 0:
        return [f"{flag}={value}"]
    return [flag, *(a_value() for _ in range(count))]


COUNTS: Counter[str] = Counter()


def kind(message: str) -> str:
    """``argument --x: expected one argument`` -> ``expected one argument``."""
    if "prints its help" in message:
        return "prints its help"
    message = re.sub(r"^argument \S+: ", "", message)
    return re.split(r"[:']| could", message)[0].strip()


def test_checker_agrees_with_vllms_parser(vllm_parsers):
    _, parser = vllm_parsers
    flags, values = _flags(), _valid_values(parser)
    assert len(flags) > 250 and len(values) > 150
    pieces = st.one_of(
        _option(flags, values),
        _option(flags, values),
        st.sampled_from(LOOSE).map(lambda t: [t]),
        st.text(alphabet="-_=.abcdeklmnoprstuvxyz0189 ", max_size=12).map(lambda t: [t]),
    )

    @settings(max_examples=4000, deadline=None, database=None,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(st.lists(pieces, max_size=5).map(lambda ps: [t for p in ps for t in p]))
    def check(extra: list[str]) -> None:
        if any(refused_flag(t) for t in extra):
            reject()  # the plan-owned check refuses first
        try:
            mine = same_verdict(vllm_parsers, extra)
        except _OutOfScope:
            COUNTS["out of scope (a value's type)"] += 1
            reject()
        verdict = "accepted" if mine is None else kind(mine)
        COUNTS[verdict] += 1
        event(verdict)

    check()
    print(f"\ndifferential verdicts: {dict(COUNTS.most_common())}")
    compared = sum(n for k, n in COUNTS.items() if not k.startswith("out of scope"))
    assert compared >= 3000, COUNTS
    assert COUNTS["accepted"] >= 200 and COUNTS["unrecognized arguments"] >= 200, COUNTS
