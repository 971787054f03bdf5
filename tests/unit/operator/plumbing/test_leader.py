"""Leader election's decisions (operator/spillway_operator/plumbing/leader.py): pure functions of
the Lease as last seen, when it was first seen and now; and the elector's loop driven
round by round against an in-memory Lease store with a manual clock."""

from __future__ import annotations

import argparse

import pytest

from spillway_operator.plumbing.kube import NotLeader, Rejected
from spillway_operator.plumbing.leader import (
    Election,
    LeaderElector,
    LeaseTiming,
    Record,
    Seen,
    decide,
    lease_spec,
    may_write,
    record_of,
    seen,
)

T = LeaseTiming()  # 15 s / 10 s / 2 s
WALL = "2026-01-01T00:00:00.000000Z"


def test_defaults_are_client_go_s_and_bad_timings_are_refused():
    assert (T.lease_duration, T.renew_deadline, T.retry_period) == (15, 10, 2)
    with pytest.raises(ValueError, match="longer than the renew deadline"):
        LeaseTiming(10, 10, 2)
    with pytest.raises(ValueError, match="retry period"):
        LeaseTiming(15, 10, 9)


def test_no_lease_is_created_with_this_candidate_as_holder():
    step = decide("a", None, 100.0, WALL, T)
    assert step.action == "create"
    assert step.record == Record("a", 15, WALL, WALL, 0)


def test_a_valid_lease_of_another_is_followed_until_it_expires_on_the_local_clock():
    s = Seen(Record("b", 15, "t0", "t0", 3), "7", since=100.0)
    assert decide("a", s, 100.0, WALL, T).action == "follow"
    assert decide("a", s, 114.9, WALL, T).action == "follow"
    step = decide("a", s, 115.0, WALL, T)
    assert step.action == "update"
    assert step.record == Record("a", 15, WALL, WALL, 4)  # one more transition


def test_the_clock_of_a_record_restarts_only_when_the_record_changes():
    rec = Record("b", 15, "t0", "t1", 0)
    first = seen(None, rec, "1", 100.0)
    again = seen(first, rec, "1", 110.0)  # re-read, unchanged: still since 100
    assert again.since == 100.0
    renewed = seen(again, Record("b", 15, "t0", "t2", 0), "2", 112.0)
    assert renewed.since == 112.0 and renewed.resource_version == "2"
    # Renewed at 112: the standby may not take over at 115 (the first sighting + 15).
    assert decide("a", renewed, 115.0, WALL, T).action == "follow"
    assert decide("a", renewed, 127.0, WALL, T).action == "update"


def test_the_holder_renews_keeping_its_acquire_time_and_transitions():
    s = Seen(Record("a", 15, "t0", "t1", 2), "5", since=100.0)
    step = decide("a", s, 300.0, WALL, T)  # even long after: it is still ours to renew
    assert step.action == "update"
    assert step.record == Record("a", 15, "t0", WALL, 2)


def test_a_released_lease_is_taken_at_once():
    s = Seen(Record("", 1, "t0", "t1", 2), "5", since=100.0)
    step = decide("a", s, 100.0, WALL, T)
    assert step.action == "update" and step.record.holder == "a"


def test_writes_stop_at_the_renew_deadline_before_any_standby_may_take_over():
    assert not may_write(None, 0.0, T)
    assert may_write(100.0, 109.9, T)
    assert not may_write(100.0, 110.0, T)
    # The standby saw that renew no earlier than it was sent (100): it may take over
    # at 115 at the earliest, 5 s after the leader stopped writing.
    s = Seen(Record("old", 15, "t0", "t1", 0), "1", since=100.0)
    takeover = next(t / 10 for t in range(1000, 2000) if decide("new", s, t / 10, WALL,
                                                                  T).action == "update")
    assert takeover - T.renew_deadline - 100.0 == pytest.approx(5.0)


def test_lease_spec_round_trips():
    rec = Record("a", 15, "t0", "t1", 3)
    assert record_of({"spec": lease_spec(rec)}) == rec
    assert record_of({"spec": {}}) == Record("", 0, None, None, 0)


# ---------------------------------------------------------------- the elector's rounds


class Store:
    """An in-memory Lease with resourceVersion checks, shared by several electors."""

    def __init__(self):
        self.lease: tuple[Record, str] | None = None
        self.rv = 0
        self.down = False  # the API server cannot be reached

    def client(self):
        store = self

        class Client:
            namespace, name = "ops", "spillway-operator"

            def _check(self):
                if store.down:
                    raise NotLeader("unreachable")  # any TemporaryError

            def get(self, timeout):
                self._check()
                return store.lease

            def create(self, record, timeout):
                self._check()
                if store.lease is not None:
                    raise Rejected("exists", 409)
                return self._put(record)

            def update(self, record, rv, timeout):
                self._check()
                if store.lease is None or store.lease[1] != rv:
                    raise Rejected("conflict", 409)
                return self._put(record)

            def _put(self, record):
                store.rv += 1
                store.lease = (record, str(store.rv))
                return str(store.rv)
        return Client()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def elector(store: Store, clock: Clock, name: str, events: list) -> LeaderElector:
    return LeaderElector(store.client(), name, T,
                         on_started=lambda: events.append((name, "started")),
                         on_stopped=lambda: events.append((name, "stopped")), clock=clock)


def round_(*electors: LeaderElector) -> None:
    for e in electors:
        e.try_once()
        e.check()


def test_two_candidates_elect_one_and_the_standby_waits_for_expiry():
    store, clock, events = Store(), Clock(), []
    a, b = elector(store, clock, "a", events), elector(store, clock, "b", events)
    round_(a, b)
    assert (a.leading, b.leading) == (True, False) and events == [("a", "started")]
    assert store.lease[0].holder == "a" and b.leader == "a"

    # a renews for a while; b follows.
    for _ in range(5):
        clock.now += 2
        round_(a, b)
    assert a.may_write() and not b.may_write() and store.lease[0].holder == "a"
    last_renew = clock.now

    # a is paused (SIGSTOP): no more rounds for a. Its gate closes at its renew deadline
    # by the clock alone, whether or not its loop runs.
    while clock.now < last_renew + 20:
        clock.now += 0.5
        b.try_once()
        b.check()
        if b.leading:
            break
        assert a.may_write() == (clock.now - last_renew < T.renew_deadline)
    assert b.leading and store.lease[0].holder == "b" and store.lease[0].transitions == 1
    # b took over no earlier than lease duration after it last saw a's renew.
    assert clock.now >= last_renew + T.lease_duration
    assert not a.may_write()
    # a resumes: it reads b's Lease, stops leading and follows.
    round_(a)
    assert not a.leading and a.leader == "b"
    assert events == [("a", "started"), ("b", "started"), ("a", "stopped")]


def test_a_leader_that_cannot_reach_the_api_server_stops_at_its_renew_deadline():
    store, clock, events = Store(), Clock(), []
    a = elector(store, clock, "a", events)
    round_(a)
    assert a.leading
    store.down = True
    start = clock.now
    while a.leading:
        clock.now += 0.5
        round_(a)
    assert clock.now - start == pytest.approx(T.renew_deadline)
    assert events == [("a", "started"), ("a", "stopped")]
    # Back again: the Lease is still a's and not expired for anyone else; a renews,
    # and its log line says so (not how it first got the Lease).
    store.down = False
    round_(a)
    assert a.leading and events[-1] == ("a", "started")
    assert a.origin == "renewed its own lease after missing the renew deadline"


def test_two_candidates_racing_for_an_expired_lease_cannot_both_win():
    store, clock, events = Store(), Clock(), []
    a, b, c = (elector(store, clock, n, events) for n in "abc")
    round_(a)
    round_(b, c)  # both see a's lease at the same moment
    clock.now += T.lease_duration + 1
    b.try_once()
    c.try_once()  # c's update carries the resourceVersion b already replaced: 409
    b.check()
    c.check()
    assert b.leading and not c.leading and store.lease[0].holder == "b"


def test_election_settings_come_from_flags_and_environment(monkeypatch):
    from spillway_operator.main import add_arguments, election_of

    def parse(argv, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        p = argparse.ArgumentParser()
        add_arguments(p)
        return election_of(p.parse_args(argv))

    assert parse(["-A"]) is None  # off unless asked for
    e = parse(["-A", "--leader-elect", "--leader-election-namespace", "ops",
               "--leader-election-identity", "me", "--lease-duration", "30"])
    assert e == Election("ops", "spillway-operator", "me", LeaseTiming(30, 10, 2))
    e = parse(["-A"], {"SPILLWAY_LEADER_ELECT": "true", "POD_NAMESPACE": "sys",
                       "POD_NAME": "op-1", "SPILLWAY_RENEW_DEADLINE": "8"})
    assert e.namespace == "sys" and e.identity.startswith("op-1_")
    assert e.timing == LeaseTiming(15, 8, 2)
    with pytest.raises(ValueError, match="renew deadline"):
        parse(["-A", "--leader-elect", "--renew-deadline", "20"])


def test_the_kube_gate_refuses_writes_before_sending_them():
    from spillway_operator.plumbing import metrics
    from spillway_operator.plumbing.kube import Kube

    allowed = [False]
    # No API client at all: a write that got past the gate would fail differently.
    kube = Kube(None, may_write=lambda: allowed[0])
    before = metrics.WRITES_FENCED._value.get()
    for verb in ("patch", "post", "put", "delete"):
        with pytest.raises(NotLeader, match="not the leader"):
            kube.request(verb, "/api/v1/namespaces/x/configmaps/y", body={})
    assert metrics.WRITES_FENCED._value.get() == before + 4
    # Reads and the Lease's own requests are not gated.
    with pytest.raises(AttributeError):
        kube.request("get", "/api/v1/namespaces/x/configmaps/y")
    with pytest.raises(AttributeError):
        kube.request("put", "/apis/coordination.k8s.io/v1/x", body={}, gated=False)
