"""e2e.gateway's rendered Envoy bootstrap: with the endpoint picker (ext_proc, override
host) and without one (``picker=None``: plain round robin, bench/routing.py --gateway's
baseline), each accepted by Envoy itself (``envoy --mode validate``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from e2e.gateway import GatewayConfig, envoy_binary, render
from e2e.gateway.envoy import FAIL_CLOSE, FAIL_OPEN

POOL = ["127.0.0.1:8001", "127.0.0.1:8002"]


def _config(picker: str | None, failure_mode: str = FAIL_OPEN) -> GatewayConfig:
    return GatewayConfig(picker=picker, endpoints=POOL, port=8080, admin_port=9901,
                         failure_mode=failure_mode)  # fmt: skip


def _filters(boot: dict) -> list[str]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return [f["name"] for f in hcm["typed_config"]["http_filters"]]


def _clusters(boot: dict) -> dict[str, dict]:
    return {c["name"]: c for c in boot["static_resources"]["clusters"]}


def test_without_a_picker_the_gateway_round_robins_with_no_ext_proc():
    for mode in (FAIL_OPEN, FAIL_CLOSE):
        boot = render(_config(None, mode))
        assert _filters(boot) == ["envoy.filters.http.router"]
        clusters = _clusters(boot)
        assert list(clusters) == ["pool"]
        pool = clusters["pool"]
        assert pool["lb_policy"] == "ROUND_ROBIN" and "load_balancing_policy" not in pool
        # the same buffering as the picked gateway's pool: only the routing differs
        picked = _clusters(render(_config("127.0.0.1:9002", mode)))["pool"]
        assert pool["per_connection_buffer_limit_bytes"] == picked[
            "per_connection_buffer_limit_bytes"]
        hosts = [e["endpoint"]["address"]["socket_address"]
                 for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]  # fmt: skip
        assert [f"{h['address']}:{h['port_value']}" for h in hosts] == POOL
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        # nothing to fail closed: only Envoy's own errors put in OpenAI's shape
        [mapper] = hcm["typed_config"]["local_reply_config"]["mappers"]
        assert mapper["body_format_override"]["json_format"]["error"]["code"] == \
            "%RESPONSE_CODE%"


def test_with_a_picker_the_gateway_asks_it_and_overrides_the_host():
    boot = render(_config("127.0.0.1:9002", FAIL_CLOSE))
    assert _filters(boot) == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    clusters = _clusters(boot)
    assert list(clusters) == ["picker", "pool"]
    policy = clusters["pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert "lb_policy" not in clusters["pool"]


@pytest.mark.parametrize(
    ("picker", "mode"),
    [(None, FAIL_OPEN), ("127.0.0.1:9002", FAIL_OPEN), ("127.0.0.1:9002", FAIL_CLOSE)],
)
def test_envoy_accepts_the_config(tmp_path, picker, mode):
    try:
        binary = envoy_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(render(_config(picker, mode))))
    out = subprocess.run([str(binary), "--mode", "validate", "-c", str(path),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "OK" in out.stdout + out.stderr


def test_envoys_own_errors_answer_in_openais_shape(tmp_path):
    """A pod Envoy cannot reach (a cut network, a pod gone) answers 503 with OpenAI's
    error body, not Envoy's text: the client sees an error it can retry."""
    import socket
    import urllib.error
    import urllib.request

    from e2e.gateway import Envoy

    try:
        envoy_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    cfg = GatewayConfig(picker=None, endpoints=[f"127.0.0.1:{port()}"], port=port(),
                        admin_port=port())
    with Envoy(cfg, tmp_path).start() as gw, pytest.raises(urllib.error.HTTPError) as got:
        urllib.request.urlopen(urllib.request.Request(
            f"{gw.url}/v1/completions", b"{}", {"Content-Type": "application/json"}),
            timeout=15)
    assert got.value.code == 503
    body = json.loads(got.value.read())
    assert body["error"]["code"] == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert "upstream" in body["error"]["message"]



def test_the_pool_finds_a_dead_pod_by_keepalive_and_by_its_health():
    """A pod cut off the network sends nothing: TCP keepalive on the pool's connections
    ends a stream open on it (tests/integration/test_gateway.py cuts one with iptables),
    and the health check keeps new requests off it; the same for both gateways."""
    for picker in (None, "127.0.0.1:9002"):
        pool = _clusters(render(_config(picker)))["pool"]
        keepalive = pool["upstream_connection_options"]["tcp_keepalive"]
        assert keepalive["keepalive_time"] == 10 and keepalive["keepalive_probes"] == 3
        [check] = pool["health_checks"]
        assert check["http_health_check"]["path"] == "/health"
        assert check["unhealthy_threshold"] == 2 and check["interval"] == "2.0s"
        assert check["no_traffic_interval"] == "2.0s"  # an idle pool is checked too
    plain = GatewayConfig(picker=None, endpoints=POOL, port=8080, admin_port=9901,
                          health_path=None)
    assert "health_checks" not in _clusters(render(plain))["pool"]
