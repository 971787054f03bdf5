"""The engine's KV-cache events: where vLLM publishes them and under which topic.

Each data-parallel rank publishes on a port declared in the pod spec: the base port
(``engine.json``'s ``kv_events_port``, from ``spec.engine.kvEvents.port``, default
5557) plus its rank, vLLM's own offset. The operator declares those ports as
``containerPorts`` (``kv-events``, ``kv-events-1``, ...), so a NetworkPolicy can allow
exactly them and a router can find them in the pod spec.

The bind address. vLLM 0.33 binds a publisher only when its endpoint looks like a
wildcard (``ZmqEventPublisher._is_bind_endpoint``: a ``*`` or a ``::`` in it) and
connects to anything else. With the pod's IP known (``SPILLWAY_POD_IP``, else
``--host`` when it is one address) and an IPv4 one, the endpoint is that IP written as
an IPv4-mapped IPv6 address, ``tcp://[::ffff:10.1.2.3]:5557``: vLLM takes it for a
bind endpoint and ZMQ binds the IPv4 address itself, so engines that share one host on
different addresses (the test fleets' loopback pod IPs) publish on the same declared
port without a clash. Otherwise (no address, or an IPv6 one, which ZMQ would bind only
with its IPv6 option, set by vLLM for ``tcp://*:0`` alone) it is the wildcard
``tcp://*:<port>``. Engines sharing one address (127.0.0.1) need distinct base ports:
``spillway-engine serve --kv-events-port``.

The topic is llm-d's convention, ``kv@<pod-ip>:<serving-port>@<served-model>``: its
indexer takes the pod's identity from the middle part and matches it with the
endpoint a gateway routes to (address and serving port), so every rank of a pod
publishes under the pod's one topic.

Before vLLM starts, :func:`check_ports_free` binds each of this pod's ports once: a
port already taken in the pod stops the engine with a line naming it, instead of a
publisher thread failing deep inside vLLM's start-up.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from spillway_engine.planner.plan import Plan
from spillway_engine.seam import KV_EVENTS_PORT, EngineOptions, canonical_flag, event_port_name

#: the pod's IP (downward API ``status.podIP``), which the KV-event publisher binds
ENV_POD_IP = "SPILLWAY_POD_IP"
#: reproducible across processes and what spillway-router computes by default
KV_EVENTS_HASH_ALGO = "sha256"

__all__ = [
    "ENV_POD_IP",
    "KV_EVENTS_HASH_ALGO",
    "KV_EVENTS_PORT",
    "EventPortTaken",
    "check_ports_free",
    "endpoint_for",
    "event_port_name",
    "events_bind_ip",
    "kv_events_args",
    "kv_events_config",
    "local_ranks",
    "topic_for",
    "user_sets",
]


class EventPortTaken(Exception):
    """A KV-event port of this pod cannot be bound (something else holds it)."""


def events_bind_ip(host: str, env: Mapping[str, str]) -> str | None:
    """The address the KV-event publisher binds: the pod's IP, else ``--host`` when it
    is one address (not a wildcard, not a name), else None (every interface)."""
    for candidate in (env.get(ENV_POD_IP, "").strip(), host):
        try:
            ip = ipaddress.ip_address(candidate)
        except ValueError:
            continue
        if not ip.is_unspecified:
            return str(ip)
    return None


def endpoint_for(bind_ip: str | None, port: int) -> str:
    """vLLM's ``endpoint`` for rank 0 (vLLM adds the rank to the port)."""
    if bind_ip is not None and ipaddress.ip_address(bind_ip).version == 4:
        return f"tcp://[::ffff:{bind_ip}]:{port}"
    return f"tcp://*:{port}"


def topic_for(pod_address: str, serving_port: int, model: str) -> str:
    """llm-d's topic: ``kv@<pod-ip>:<serving-port>@<model>`` (an IPv6 address in
    brackets, as Go's net.JoinHostPort writes it)."""
    host = f"[{pod_address}]" if ":" in pod_address else pod_address
    return f"kv@{host}:{serving_port}@{model}"


def kv_events_config(
    bind_ip: str | None, port: int = KV_EVENTS_PORT, topic: str = ""
) -> dict[str, Any]:
    """``--kv-events-config``: ZMQ on :func:`endpoint_for`'s endpoint, under ``topic``."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint_for(bind_ip, port),
    }
    if topic:
        config["topic"] = topic
    return config


def user_sets(user_args: Sequence[str], flag: str) -> bool:
    """Whether the user's extra args give ``flag`` (any spelling vLLM accepts)."""
    return any(a.startswith("--") and canonical_flag(a) == flag for a in user_args)


def kv_events_args(
    plan: Plan,
    options: EngineOptions,
    user_args: Sequence[str],
    bind_ip: str | None,
    *,
    serving_port: int = 8000,
    port: int | None = None,
    host_name: str = "localhost",
) -> tuple[list[str], list[str]]:
    """The KV-event flags and notes; a flag the user gives in extra args is theirs.
    ``port``: the base port (default: engine.json's); ``host_name``: the topic's pod
    part when no address is known."""
    if not options.kv_events:
        return [], []
    if not plan.enable_prefix_caching:
        return [], ["prefix caching is off in the plan: no KV events"]
    args: list[str] = []
    notes: list[str] = []
    if user_sets(user_args, "--kv-events-config"):
        notes.append("KV events: --kv-events-config from the extra args")
    else:
        base = options.kv_events_port if port is None else port
        model = options.served_model_name or options.model or ""
        topic = topic_for(bind_ip or host_name, serving_port, model)
        config = json.dumps(kv_events_config(bind_ip, base, topic), separators=(",", ":"))
        args += ["--kv-events-config", config]
    if user_sets(user_args, "--prefix-caching-hash-algo"):
        notes.append(
            "KV events: --prefix-caching-hash-algo from the extra args (routers must hash "
            "with the same algorithm)"
        )
    else:
        args += ["--prefix-caching-hash-algo", KV_EVENTS_HASH_ALGO]
    return args, notes


def local_ranks(data_parallel_size: int, nnodes: int, node_rank: int) -> range:
    """The data-parallel ranks whose schedulers (and publishers) run in this pod: all of
    them on one node; ``dp / nnodes`` of them per node when the ranks span nodes; none
    on a worker of a replica with one rank (its scheduler is the leader's)."""
    if nnodes <= 1:
        return range(data_parallel_size)
    if data_parallel_size <= 1:
        return range(1) if node_rank == 0 else range(0)
    local = data_parallel_size // nnodes
    return range(node_rank * local, (node_rank + 1) * local)


def check_ports_free(bind_ip: str | None, ports: Sequence[int]) -> None:
    """Bind (and release) each port as the publisher will; :class:`EventPortTaken`
    names the first one something else holds."""
    for port in ports:
        family = socket.AF_INET6 if bind_ip and ":" in bind_ip else socket.AF_INET
        address = bind_ip or "0.0.0.0"
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # as ZMQ does: a port left in TIME_WAIT by an earlier engine is not taken
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
                s.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise EventPortTaken(
                        f"KV-event port {port} on {address} is already taken in the pod "
                        "(another process listens on it): give the engine another "
                        "spec.engine.kvEvents.port (rank r publishes on port + r)"
                    ) from None
                raise EventPortTaken(
                    f"cannot bind KV-event port {port} on {address}: {e.strerror or e}"
                ) from None
