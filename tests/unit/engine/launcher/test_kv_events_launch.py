"""Where the engine publishes its KV events: declared ports (base + data-parallel rank)
on the pod's IP, llm-d's topic, and a port already taken stopping the start
(spillway_engine.launcher.kv_events)."""

from __future__ import annotations

import json
import socket

import pytest

from spillway_engine.launcher import kv_events, serve
from spillway_engine.launcher.kv_events import endpoint_for, local_ranks, topic_for
from spillway_engine.launcher.serve import build_command
from spillway_engine.seam import EngineOptions, EngineOptionsError, parse_engine_options
from tests.unit.engine.launcher.test_engine_serve import (  # noqa: F401 (autouse fixture)
    LLAMA,
    OPTIONS,
    flag,
    one_error_line,
    plan_for,
    pod_host,
    ready_to_exec,
    run,
    write,
)


def events_config(cmd: list[str]) -> dict:
    return json.loads(flag(cmd, "--kv-events-config"))


def test_kv_events_are_on_by_default_on_the_declared_port_with_llm_ds_topic():
    cmd, notes = build_command(plan_for(LLAMA), OPTIONS)
    assert notes == []
    config = events_config(cmd)
    assert config["endpoint"] == "tcp://*:5557"  # no address known: every interface
    assert config["publisher"] == "zmq" and config["enable_kv_cache_events"] is True
    assert config["topic"].startswith("kv@") and config["topic"].endswith(":8000@served")
    assert flag(cmd, "--prefix-caching-hash-algo") == "sha256"
    # the pod's IPv4 address, written so that vLLM binds it (a '::' in the endpoint)
    cmd, _ = build_command(plan_for(LLAMA), OPTIONS, port=8100, events_ip="10.1.2.3")
    assert events_config(cmd) == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://[::ffff:10.1.2.3]:5557", "topic": "kv@10.1.2.3:8100@served"}
    # the base port from engine.json, or the command line's override
    options = EngineOptions(model="org/m", kv_events_port=6100)
    cmd, _ = build_command(plan_for(LLAMA), options, events_ip="10.1.2.3")
    assert events_config(cmd)["endpoint"] == "tcp://[::ffff:10.1.2.3]:6100"
    assert events_config(cmd)["topic"] == "kv@10.1.2.3:8000@org/m"
    cmd, _ = build_command(plan_for(LLAMA), options, events_ip="10.1.2.3", events_port=7000)
    assert events_config(cmd)["endpoint"] == "tcp://[::ffff:10.1.2.3]:7000"


def test_an_ipv6_pod_binds_every_interface_and_brackets_its_topic():
    assert endpoint_for("fd00::7", 5557) == "tcp://*:5557"
    assert topic_for("fd00::7", 8000, "m") == "kv@[fd00::7]:8000@m"
    assert endpoint_for(None, 5600) == "tcp://*:5600"


def test_zmq_binds_the_mapped_endpoint_on_the_ipv4_address():
    """ZMQ (without its IPv6 option, as vLLM leaves it) binds the IPv4 address behind
    the mapped form; the contract tier runs vLLM's own publisher on it."""
    zmq = pytest.importorskip("zmq")
    port = _free_port()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUB)
        sock.bind(endpoint_for("127.0.0.1", port))
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
        sock.close(0)
    finally:
        ctx.term()


def test_offload_tiers_describe_their_blocks_when_events_are_on():
    """Host and disk stores carry every block hash of the chunk and its tokens (vLLM's
    self-describing events), what an indexer keying blocks by tokens needs."""
    cmd, _ = build_command(plan_for(LLAMA), OPTIONS)
    extra = json.loads(flag(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["self_describing_kv_events"] is True
    cmd, _ = build_command(plan_for(LLAMA), EngineOptions(model="m", kv_events=False))
    extra = json.loads(flag(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert "self_describing_kv_events" not in extra


def test_kv_events_off_or_without_prefix_caching():
    off = EngineOptions(model="m", kv_events=False)
    cmd, _ = build_command(plan_for(LLAMA), off)
    assert "--kv-events-config" not in cmd and "--prefix-caching-hash-algo" not in cmd
    cmd, notes = build_command(plan_for(LLAMA, enable_prefix_caching=False), OPTIONS)
    assert "--kv-events-config" not in cmd and any("prefix caching is off" in n for n in notes)


def test_kv_event_flags_in_extra_args_are_the_users():
    mine = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"})
    options = EngineOptions(model="m", extra_args=(
        "--kv-events-config", mine, "--prefix-caching-hash-algo=sha256_cbor"))
    cmd, notes = build_command(plan_for(LLAMA), options)
    assert flag(cmd, "--kv-events-config") == mine
    assert "--prefix-caching-hash-algo" not in cmd and cmd[-1].endswith("sha256_cbor")
    assert len(notes) == 2


@pytest.mark.parametrize(
    ("pod_ip", "host", "bound"),
    [
        ("10.1.2.3", "0.0.0.0", "10.1.2.3"),
        (" fd00::7 ", "0.0.0.0", "fd00::7"),
        ("", "127.0.0.5", "127.0.0.5"),  # the fleet's engines: --host is the pod IP
        (None, "::", None),
        (None, "localhost", None),  # a name is not an address to bind
        ("not-an-ip", "0.0.0.0", None),
    ],
)
def test_events_bind_the_pods_ip(pod_ip, host, bound):
    env = {} if pod_ip is None else {kv_events.ENV_POD_IP: pod_ip}
    assert kv_events.events_bind_ip(host, env) == bound


def test_options_read_kv_events(tmp_path):
    path = tmp_path / "engine.json"
    assert parse_engine_options({"model": "m"}, path).kv_events is True
    assert parse_engine_options({"model": "m"}, path).kv_events_port == 5557
    assert parse_engine_options({"model": "m", "kv_events": False}, path).kv_events is False
    assert parse_engine_options({"model": "m", "kv_events_port": 6000}, path).kv_events_port \
        == 6000
    with pytest.raises(EngineOptionsError, match="kv_events must be true or false"):
        parse_engine_options({"model": "m", "kv_events": "yes"}, path)
    for bad in (0, 70000, "5557", 5557.0, True):
        with pytest.raises(EngineOptionsError, match="kv_events_port"):
            parse_engine_options({"model": "m", "kv_events_port": bad}, path)


@pytest.mark.parametrize(
    ("dp", "nnodes", "node", "ranks"),
    [(1, 1, 0, [0]), (4, 1, 0, [0, 1, 2, 3]), (4, 2, 0, [0, 1]), (4, 2, 1, [2, 3]),
     (1, 2, 0, [0]), (1, 2, 1, [])],
)
def test_the_ranks_whose_publishers_run_in_a_pod(dp, nnodes, node, ranks):
    assert list(local_ranks(dp, nnodes, node)) == ranks


def test_serve_binds_events_on_the_pod_ip_without_vllm_host_ip(tmp_path, capsys, monkeypatch):
    _plan, path, fake = ready_to_exec(tmp_path, monkeypatch)
    monkeypatch.setenv(kv_events.ENV_POD_IP, "127.0.0.1")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    port = _free_port()
    code, _, _ = run(capsys, "serve", "--plan", str(path), "--kv-events-port", str(port))
    assert code == 0
    [(_exe, argv, env)] = fake.calls
    assert events_config(argv) == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}", "topic": "kv@127.0.0.1:8000@m"}
    assert "VLLM_HOST_IP" not in env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_event_port_stops_the_start_with_a_line_naming_it(tmp_path, capsys, monkeypatch,
                                                                  pod_host):  # noqa: F811
    _plan, path, fake = ready_to_exec(tmp_path, monkeypatch)
    monkeypatch.setenv(kv_events.ENV_POD_IP, "127.0.0.1")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        code, out, err = run(capsys, "serve", "--plan", str(path), "--kv-events-port", str(taken))
    assert code == 2 and out == "" and fake.calls == []
    line = one_error_line(err)
    assert f"KV-event port {taken} on 127.0.0.1 is already taken in the pod" in line
    # and the container's termination message says the same (kubectl describe shows it)
    assert f"KV-event port {taken}" in (pod_host / "termination-log").read_text()


def test_a_taken_port_of_a_later_rank_is_named_and_user_endpoints_are_not_checked():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        with pytest.raises(kv_events.EventPortTaken, match=f"port {taken} "):
            kv_events.check_ports_free("127.0.0.1", [_free_port(), taken])
        # the user's own --kv-events-config: their ports, not checked
        options = EngineOptions(model="m", extra_args=(
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True})))
        plan = plan_for(LLAMA)
        cmd, _ = build_command(plan, options)
        serve.check_event_ports(plan, options, cmd, serve.multinode.Node(), "127.0.0.1", taken)


def test_a_free_port_in_time_wait_is_not_taken():
    """An earlier engine's connections left in TIME_WAIT do not stop a restart."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end waits in TIME_WAIT
        client.close()
    kv_events.check_ports_free("127.0.0.1", [port])


def test_dry_run_shows_the_port_and_the_bad_flag_exits_2(tmp_path, capsys):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m",
                                                                   "kv_events_port": 6200})
    code, out, _ = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 0 and "tcp://*:6200" in out
    code, out, err = run(capsys, "serve", "--plan", str(path), "--dry-run",
                         "--kv-events-port", "0")
    assert code == 2 and out == "" and "--kv-events-port" in one_error_line(err)
