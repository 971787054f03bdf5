"""bench/routing.py --gateway's pieces that need no processes: the modules import (it
broke once when bench.autoscale dropped a constant it took), the trace as chat messages
is the same prompt ids at the engine, and GIE's picker is configured as its chart does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import routing_gateway, routing_trace  # noqa: E402
from e2e.gateway.envoy import render  # noqa: E402
from e2e.gateway.gie import gateway_config, picker_config, pod_addresses  # noqa: E402
from spillway_engine.word_tokenizer import chat_tokens  # noqa: E402


def test_the_trace_as_chat_messages_is_the_same_prompt_at_the_engine():
    items = routing_trace.trace(2, 30.0, 0)
    messages = routing_trace.trace_messages(2, 30.0, 0)
    assert len(items) == len(messages) > 20
    for item in items:
        assert chat_tokens(messages[item.rid]) == list(item.prompt)
    # what GIE's prefix scorer hashes: the messages' JSON, several characters a token
    assert 4.0 < routing_gateway._chars_per_token(items, messages) < 12.0


def test_gies_picker_gets_its_charts_profile_sized_from_the_engines():
    cfg = json.loads(picker_config(16, 512, chars_per_token=7.9))
    weights = {p["pluginRef"]: p["weight"] for p in cfg["schedulingProfiles"][0]["plugins"]}
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                       "prefix-cache-scorer": 3}
    (prefix,) = [p for p in cfg["plugins"] if p["type"] == "prefix-cache-scorer"]
    assert prefix["parameters"] == {"autoTune": False, "blockSize": 126,
                                    "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 512}


def test_envoy_talks_to_gies_picker_full_duplex_both_ways_failing_closed():
    ext_proc = render(gateway_config("127.0.0.1:9002", ["127.0.0.2:8000"]))
    hcm = ext_proc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (proc,) = [f for f in hcm["typed_config"]["http_filters"]
               if f["name"] == "envoy.filters.http.ext_proc"]
    mode = proc["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_trailer_mode"] == "SEND"
    assert proc["typed_config"]["failure_mode_allow"] is False


def test_pod_addresses_are_distinct_loopback_ips_on_one_port():
    addresses = pod_addresses(3)
    ips = [a.rsplit(":", 1)[0] for a in addresses]
    assert len(set(ips)) == 3 and all(ip.startswith("127.") for ip in ips)
    assert len({a.rsplit(":", 1)[1] for a in addresses}) == 1


def test_the_routing_bench_imports():
    from bench import routing

    assert routing.GATEWAY_SPEED > 0 and routing.POLICIES[0] == "spillway-events"
