"""The load generator: pure seeded traces, routing, summaries, and its command line."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
import statistics

import pytest

from spillway_cli import loadgen
from spillway_cli.loadgen import (
    Result,
    Router,
    TraceRequest,
    TraceSpec,
    generate_trace,
    percentile,
    run_load,
    summarize,
    to_replay_items,
)
from spillway_engine.word_tokenizer import chat_tokens


def small(kind: str, **kw) -> TraceSpec:
    base = dict(
        kind=kind,
        rate=20,
        num_requests=120,
        duration=None,
        seed=1,
        users=4,
        turns=5,
        system_tokens=50,
        user_tokens=20,
        reply_tokens=20,
        prefixes=3,
        prefix_tokens=100,
        question_tokens=10,
        agents=2,
        context_tokens=300,
        step_tokens=40,
        loop_steps=6,
    )
    base.update(kw)
    return TraceSpec(**base)


@pytest.mark.parametrize("kind", loadgen.TRACE_KINDS)
def test_traces_are_pure_functions_of_the_seed(kind):
    assert generate_trace(small(kind)) == generate_trace(small(kind))
    assert generate_trace(small(kind)) != generate_trace(small(kind, seed=2))


def test_chat_turns_resend_the_growing_conversation():
    trace = generate_trace(small("chat"))
    by_session: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    grew = 0
    for turns in by_session.values():
        assert len(turns) <= 5
        for prev, nxt in itertools.pairwise(turns):
            a, b = chat_tokens(prev.messages), chat_tokens(nxt.messages)
            assert b[: len(a) - 1] == a[:-1]  # everything but the generation prompt
            assert len(b) > len(a)
            assert nxt.messages[len(prev.messages)]["role"] == "assistant"
            grew += 1
    assert grew > 50
    assert {r.messages[0]["role"] for r in trace} == {"system"}


def test_shared_prefix_users_share_few_system_prompts():
    trace = generate_trace(small("shared-prefix"))
    systems = {r.messages[0]["content"] for r in trace}
    assert len(systems) == 3
    assert len({r.messages[1]["content"] for r in trace}) == len(trace)
    assert all(len(r.messages[0]["content"].split()) == 100 for r in trace)


def test_agentic_loops_resend_the_tool_context():
    trace = generate_trace(small("agentic"))
    contexts = {r.messages[0]["content"] for r in trace}
    assert len(contexts) >= 2
    assert max(len(r.messages) for r in trace) == 2 + 2 * 5
    assert any(m["role"] == "tool" for r in trace for m in r.messages)


def test_mixed_interleaves_the_kinds():
    trace = generate_trace(small("mixed"))
    assert [r.kind for r in trace[:3]] == ["chat", "shared-prefix", "agentic"]


def test_arrival_processes():
    const = generate_trace(small("chat", arrival="constant", rate=4))
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(const)]
    assert all(g == pytest.approx(0.25) for g in gaps)
    poisson = generate_trace(small("chat", rate=4, num_requests=2000))
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(poisson)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)


def test_duration_and_count_bounds():
    timed = generate_trace(small("chat", num_requests=None, duration=10, rate=5))
    assert 25 < len(timed) < 80 and timed[-1].arrival <= 10
    both = generate_trace(small("chat", num_requests=7, duration=100))
    assert len(both) == 7


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind="nope"),
        dict(rate=0),
        dict(num_requests=None, duration=None),
        dict(arrival="bursty"),
        dict(users=0),
        dict(prefix_tokens=-1),
    ],
)
def test_invalid_specs(kw):
    kind = kw.pop("kind", "chat")
    with pytest.raises(ValueError):
        generate_trace(small(kind, **kw))


def test_replay_items_tokenise_like_the_server():
    trace = generate_trace(small("shared-prefix", num_requests=5))
    items = to_replay_items(trace)
    assert [i.arrival for i in items] == [r.arrival for r in trace]
    assert items[0].prompt == chat_tokens(trace[0].messages)
    assert items[0].max_tokens == trace[0].max_tokens


def test_routing():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3/"]
    trace = generate_trace(small("shared-prefix"))
    rr = Router(urls, "round-robin")
    assert [rr.pick(r) for r in trace[:4]] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "http://127.0.0.1:3",
        "http://127.0.0.1:1",
    ]
    affinity = Router(urls, "prefix-affinity")
    seen: dict[str, set[str]] = {}
    for r in trace:
        seen.setdefault(r.session, set()).add(affinity.pick(r))
    assert all(len(v) == 1 for v in seen.values())
    with pytest.raises(ValueError):
        Router([], "round-robin")


def test_percentile_and_summary():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 95) == 95
    results = [
        Result(
            ok=True,
            ttft_measured=0.1,
            ttft_returned=0.05,
            latency=0.3,
            prompt_tokens=100,
            completion_tokens=10,
            cached_tokens=60,
        ),
        Result(
            ok=True,
            ttft_measured=0.2,
            latency=0.4,
            prompt_tokens=100,
            completion_tokens=10,
            cached_tokens=0,
        ),
        Result(ok=False, error="timeout"),
    ]
    s = summarize(results, 2.0)
    assert (s.requests, s.ok, s.errors) == (3, 2, 1)
    assert s.error_kinds == {"timeout": 1}
    assert s.ttft_measured_p50 == 0.1 and s.ttft_returned_p50 == 0.05
    assert s.prompt_tokens == 200 and s.cached_tokens == 60
    text = "\n".join(s.lines())
    assert "3 (2 ok, 1 errors)" in text and "30.0%" in text and "timeout" in text


def test_unreachable_server_counts_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    trace = generate_trace(small("chat", num_requests=3))
    results, _ = asyncio.run(
        run_load(trace, [f"http://127.0.0.1:{port}"], timeout=5, time_scale=100)
    )
    assert len(results) == 3 and not any(r.ok for r in results)
    assert all(r.error for r in results)


def parse(argv):
    parser = argparse.ArgumentParser(prog="spillway")
    loadgen.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_wiring_and_bad_arguments(capsys):
    args = parse(
        [
            "loadgen",
            "--url",
            "http://127.0.0.1:9",
            "--trace",
            "agentic",
            "--requests",
            "5",
            "--rate",
            "2",
        ]
    )
    assert args.func is loadgen.run
    spec = loadgen.spec_from_args(args)
    assert spec.kind == "agentic" and spec.num_requests == 5 and spec.duration is None
    assert loadgen.run(parse(["loadgen", "--url", "ftp://x", "--requests", "1"])) == 2
    assert loadgen.run(parse(["loadgen", "--url", "http://127.0.0.1:9", "--rate", "0"])) == 2
    err = capsys.readouterr().err
    assert err.count("spillway loadgen: error:") == 2


def test_cli_against_nothing_reports_errors(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = loadgen.run(
        parse(
            [
                "loadgen",
                "--url",
                f"http://127.0.0.1:{port}",
                "--requests",
                "2",
                "--rate",
                "50",
                "--timeout",
                "5",
            ]
        )
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "2 (0 ok, 2 errors)" in out
