"""Reading a model's config.json: hostile or broken text gets one plain error, never a crash."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spillway_engine.planner.model_config import (
    MAX_CONFIG_DEPTH,
    ModelConfigSourceError,
    ModelConfigUnreachable,
    _depth,
    load_hub,
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


# ------------------------------------------------------------------ from a hub
# A hub on loopback that answers huggingface_hub's resolve requests as the real one
# does (X-Repo-Commit, ETag; X-Error-Code on a 404), driven through the real client.


class _Hub(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, with_body: bool) -> None:
        status, body, headers = self.server.answer
        self.server.requests += 1
        self.send_response(status)
        for k, v in {"X-Repo-Commit": "a" * 40, "ETag": '"e1"', **headers}.items():
            if v is not None:  # None: a header this answer lacks
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)


@pytest.fixture
def online(monkeypatch):
    """huggingface_hub online whatever the session's environment: the contract tier's
    harness sets HF_HUB_OFFLINE=1 for vLLM, and the client reads it at each call."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(online):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.requests, server.daemon_threads = 0, True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})


@pytest.mark.parametrize(("answer", "needle"), [
    ((200, b"[" * 1000 + b"]" * 1000, {}), "nests arrays/objects"),
    ((200, b'{"architectures": ', {}), "not valid JSON"),
    ((200, b"[1, 2]", {}), "must hold a JSON object"),
    ((404, b"{}", {"X-Error-Code": "RepoNotFound"}), "was not found"),
    ((404, b"{}", {"X-Error-Code": "EntryNotFound"}), "has no config.json"),
    ((401, b"{}", {}), "401"),
    # a plain mirror: no X-Error-Code; huggingface_hub calls it "not in the cache"
    ((404, b"Not Found", {}), r"the hub answered HTTP 404 \(not found\)"),
    ((403, b"Forbidden", {}), "the hub answered HTTP 403"),
    ((200, LLAMA.encode(), {"X-Repo-Commit": None}), "does not seem to be served by a "
                                                     "Hugging Face Hub endpoint"),
], ids=["too-deep", "truncated", "not-an-object", "no-repo", "no-config", "unauthorised",
        "plain-404", "plain-403", "not-a-hub"])
def test_what_the_hub_answers_is_permanent(hub, tmp_path, answer, needle):
    """Content that is not a config.json, and the hub's own answers, are the same the
    next time: ModelConfigSourceError, never ModelConfigUnreachable."""
    hub.answer = answer
    endpoint = f"http://127.0.0.1:{hub.server_port}"
    with pytest.raises(ModelConfigSourceError, match=needle) as info:
        load_hub("org/model", cache_dir=str(tmp_path), endpoint=endpoint)
    assert not isinstance(info.value, ModelConfigUnreachable)


def test_a_hub_that_does_not_answer_is_unreachable(online, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelConfigUnreachable, match="unreachable"):
        load_hub("org/model", cache_dir=str(tmp_path), endpoint=f"http://127.0.0.1:{port}")


def test_a_good_config_from_the_hub_loads(hub, tmp_path):
    hub.answer = (200, LLAMA.encode(), {})
    config = load_hub("org/model", cache_dir=str(tmp_path),
                      endpoint=f"http://127.0.0.1:{hub.server_port}")
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_the_operator_refuses_a_hostile_hub_config_once(hub, tmp_path):
    """The reconciler's classes: hostile content from the hub is ModelConfigInvalid
    (refused, not retried), as from a ConfigMap; before, every hub error was
    ModelConfigUnavailable and retried with back-off for ever, the hub asked each time."""
    from spillway_operator.flow.reconciler import ConfigInvalid, ConfigResolver, plan_failure
    from spillway_operator.flow.spec import InferenceDeploymentSpec

    hub.answer = (200, b"[" * 1000 + b"]" * 1000, {})
    resolver = ConfigResolver(None, hub_endpoint=f"http://127.0.0.1:{hub.server_port}",
                              hub_cache_dir=str(tmp_path))
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"name": "org/model"}, "offload": {"hostMemory": "1Gi"}})
    with pytest.raises(ConfigInvalid) as info:
        resolver.resolve("ns", spec)
    reason, message, outcome = plan_failure(info.value)
    assert (reason, outcome) == ("ModelConfigInvalid", "refused")
    assert "nests arrays/objects" in message


class _TokenSecret:
    """The one read the resolver makes of the API server for a hub model: the token
    Secret's key and resourceVersion."""

    def __init__(self) -> None:
        self.token, self.version = "hf_1", "100"

    def read_secret_key_version(self, namespace, name, key):
        return self.token, self.version


def test_a_refused_model_is_asked_again_only_when_what_was_asked_changes(hub, tmp_path):
    """The hub's refusal is remembered: a resync (same spec, Secret and revision) asks
    the hub nothing; a new resourceVersion of the token Secret, a new generation of the
    spec, or another revision asks again. Before, every resync fetched again."""
    from spillway_operator.flow.reconciler import ConfigInvalid, ConfigResolver
    from spillway_operator.flow.spec import InferenceDeploymentSpec

    hub.answer = (404, b"{}", {"X-Error-Code": "RepoNotFound"})
    secret = _TokenSecret()
    resolver = ConfigResolver(secret, hub_endpoint=f"http://127.0.0.1:{hub.server_port}",
                              hub_cache_dir=str(tmp_path))

    def asks(version=("uid-1", 1), revision=None) -> int:
        """The hub's requests for one reconcile's resolve."""
        spec = InferenceDeploymentSpec.model_validate({
            "model": {"name": "org/model", "revision": revision,
                      "tokenSecretRef": {"name": "hf"}},
            "offload": {"hostMemory": "1Gi"}})
        before = hub.requests
        with pytest.raises(ConfigInvalid, match="was not found"):
            resolver.resolve("ns", spec, "chat", version)
        return hub.requests - before

    assert asks() >= 1
    assert asks() == asks() == 0  # resyncs
    secret.version = "101"  # a new token, say
    assert asks() >= 1 and asks() == 0
    assert asks(("uid-1", 2)) >= 1 and asks(("uid-1", 2)) == 0  # the spec changed
    assert asks(("uid-2", 1)) >= 1  # deleted and created again
    assert asks(("uid-2", 1), revision="v2") >= 1
    hub.answer = (200, LLAMA.encode(), {})  # the model is published: next spec change
    assert asks(("uid-2", 1)) == 0
    spec = InferenceDeploymentSpec.model_validate({
        "model": {"name": "org/model", "tokenSecretRef": {"name": "hf"}},
        "offload": {"hostMemory": "1Gi"}})
    assert resolver.resolve("ns", spec, "chat", ("uid-2", 2))["hidden_size"] == 64


def test_a_slow_hub_holds_no_reconcile_worker(hub, tmp_path):
    """The hub fetch runs off the reconcile path: a resolve waits at most the fetch
    threads' wait and answers "fetching" (temporary); the object is queued again when
    the hub answers, and the next resolve takes the answer without asking again. Past
    the fetch's budget its askers are told the hub gave no answer. Before, a reconcile
    worker waited for the whole fetch (huggingface_hub's retries: about 23 s)."""
    from spillway_operator.flow.hub_fetch import HubFetches
    from spillway_operator.flow.reconciler import ConfigResolver, ConfigUnavailable
    from spillway_operator.flow.spec import InferenceDeploymentSpec

    gate = threading.Event()
    real = _Hub._answer

    def slow(self, with_body):
        gate.wait(10)
        real(self, with_body)

    hub.RequestHandlerClass = type("SlowHub", (_Hub,), {"_answer": slow})
    hub.answer = (200, LLAMA.encode(), {})
    fetches = HubFetches(wait_seconds=0.2, budget_seconds=30)
    queued: list[tuple[str, str]] = []
    fetches.on_done = queued.append
    resolver = ConfigResolver(None, hub_endpoint=f"http://127.0.0.1:{hub.server_port}",
                              hub_cache_dir=str(tmp_path), fetches=fetches)
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"name": "org/model"}, "offload": {"hostMemory": "1Gi"}})
    for _ in range(2):  # the retry meets the same fetch, still running
        started = time.monotonic()
        with pytest.raises(ConfigUnavailable, match="fetching it from the hub"):
            resolver.resolve("ns", spec, "chat", ("u", 1))
        assert time.monotonic() - started < 2
    gate.set()
    deadline = time.monotonic() + 10
    while not queued and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queued == [("ns", "chat")]
    requests = hub.requests
    assert resolver.resolve("ns", spec, "chat", ("u", 1))["hidden_size"] == 64
    assert hub.requests == requests

    gate.clear()  # a hub that never answers: the budget ends the wait
    fetches.budget_seconds = 0.5
    other = InferenceDeploymentSpec.model_validate(
        {"model": {"name": "org/other"}, "offload": {"hostMemory": "1Gi"}})
    with pytest.raises(ConfigUnavailable, match="fetching"):
        resolver.resolve("ns", other, "b", ("u", 1))
    time.sleep(0.6)
    with pytest.raises(ConfigUnavailable, match="the hub gave no answer within"):
        resolver.resolve("ns", other, "b", ("u", 1))
    gate.set()
    fetches.shutdown(wait=True)  # the hung fetch ends before the hub does
