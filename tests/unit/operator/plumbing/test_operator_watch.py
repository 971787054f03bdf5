"""The operator's own watches: the pure parts (the integration tier runs them against
the real API server)."""

from __future__ import annotations

import pytest

from spillway_operator import main
from spillway_operator.plumbing import watch


def test_lines_are_whole_however_the_chunks_cut_them():
    stream = b'{"type":"ADDED"}\n{"type":"MODIFIED","object":{"a":1}}\n\n{"type":"DELETED"}'
    want = [b'{"type":"ADDED"}', b'{"type":"MODIFIED","object":{"a":1}}', b'{"type":"DELETED"}']
    for size in (1, 2, 3, 7, 16, len(stream)):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert list(watch.lines(chunks)) == want
    assert list(watch.lines([])) == []
    assert list(watch.lines([b"\n", b"  \n"])) == []


def test_paths_of_the_watched_kinds():
    assert watch.DEPLOYMENTS.path("team-a") == "/apis/apps/v1/namespaces/team-a/deployments"
    assert watch.PODS.path(None) == "/api/v1/pods"
    assert watch.POD_DISRUPTION_BUDGETS.path("x") == \
        "/apis/policy/v1/namespaces/x/poddisruptionbudgets"


def test_the_backoff_never_ends():
    delays = watch._backoffs()
    assert [next(delays) for _ in range(6)] == [1, 2, 5, 10, 10, 10]


@pytest.mark.parametrize("namespace", ["team-*", "Team", "-a", "a" * 64, "a.b"])
def test_a_namespace_pattern_is_refused_with_a_clear_message(namespace, capsys):
    assert main.main(["-n", "ok", f"--namespace={namespace}", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert repr(namespace) in err and "not a namespace name" in err
