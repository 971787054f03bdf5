"""The simulator's ``vllm:*`` metrics exist in vLLM 0.33.0 with the same type and labels.

vLLM's metric definitions are read from the installed package's source with ``ast``
(nothing is imported, so this runs in seconds):

- ``v1/metrics/loggers.py``: ``self._gauge_cls(name="vllm:...", labelnames=...)`` (and
  Counter / Histogram) calls; ``labelnames`` resolved from the function's
  ``labelnames = [...]`` list and ``labelnames + [...]`` sums.
- ``v1/kv_offload`` + the offloading connector: dicts mapping a metric-name constant to
  ``Offloading{Counter,Gauge,Histogram}Metadata(...)``; the connector prefixes the
  engine's base labels; ``vllm:kv_offload_config_info`` takes ``CPUOffloadingInfo``'s
  field names as labels.
- ``v1/metrics/buckets.py``: the default histogram buckets.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.contract

BASE = ["model_name", "engine"]
KIND_BY_CALL = {
    "_gauge_cls": "gauge",
    "_counter_cls": "counter",
    "_histogram_cls": "histogram",
    "Gauge": "gauge",
    "Counter": "counter",
    "Histogram": "histogram",
}
KIND_BY_METADATA = {
    "OffloadingCounterMetadata": "counter",
    "OffloadingGaugeMetadata": "gauge",
    "OffloadingHistogramMetadata": "histogram",
}


@pytest.fixture(scope="module")
def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm 0.33.0 is not installed: the contract tier must not skip")
    root = Path(next(iter(spec.submodule_search_locations)))
    version = (root / "version.py").read_text() if (root / "version.py").exists() else ""
    dist = list(root.parent.glob("vllm-*.dist-info"))
    assert "0.33.0" in version or any("0.33.0" in d.name for d in dist), "need vLLM 0.33.0"
    return root


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _str_list(node: ast.AST, env: dict[str, list[str]]) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple)):
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return [e.value for e in node.elts]  # type: ignore[attr-defined]
        return None
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _str_list(node.left, env), _str_list(node.right, env)
        return None if left is None or right is None else left + right
    return None


def logger_metrics(path: Path) -> dict[str, tuple[str, list[str] | None]]:
    """name -> (type, label names) for every metric constructed in loggers.py."""
    tree = ast.parse(path.read_text())
    out: dict[str, tuple[str, list[str] | None]] = {}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        env: dict[str, list[str]] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    value = _str_list(node.value, env)
                    if value is not None:
                        env[target.id] = value
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            kind = KIND_BY_CALL.get(_call_name(node.func) or "")
            if kind is None:
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            name = kw.get("name")
            if not (isinstance(name, ast.Constant) and str(name.value).startswith("vllm:")):
                continue
            labels = _str_list(kw["labelnames"], env) if "labelnames" in kw else []
            out[name.value] = (kind, labels)
    return out


def _string_constants(paths: list[Path]) -> dict[str, str]:
    """``NAME`` and ``Class.NAME`` -> value for module and class level string constants."""
    out: dict[str, str] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            scopes = [("", node)]
            if isinstance(node, ast.ClassDef):
                scopes = [(node.name + ".", n) for n in node.body]
            for prefix, stmt in scopes:
                if (
                    isinstance(stmt, ast.Assign)
                    and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    out[prefix + stmt.targets[0].id] = stmt.value.value
    return out


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def offloading_metrics(root: Path) -> dict[str, tuple[str, list[str] | None]]:
    files = [
        root / "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
        *sorted((root / "v1/kv_offload").rglob("*.py")),
    ]
    consts = _string_constants(files)
    out: dict[str, tuple[str, list[str] | None]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=False):
                if not isinstance(value, ast.Call):
                    continue
                kind = KIND_BY_METADATA.get(_call_name(value.func) or "")
                if kind is None or key is None:
                    continue
                if isinstance(key, ast.Constant):
                    name = key.value
                else:
                    dotted = _dotted(key)
                    name = consts.get(dotted or "") or consts.get((dotted or "").split(".")[-1])
                if not isinstance(name, str) or not name.startswith("vllm:"):
                    continue
                kw = {k.arg: k.value for k in value.keywords if k.arg}
                extra = _str_list(kw["labelnames"], {}) if "labelnames" in kw else []
                out.setdefault(name, (kind, None if extra is None else BASE + extra))
    # vllm:kv_offload_config_info: a gauge whose labels are the CPU info fields.
    common = (root / "v1/kv_offload/cpu/common.py").read_text()
    fields: list[str] = []
    for node in ast.walk(ast.parse(common)):
        if isinstance(node, ast.ClassDef) and node.name == "CPUOffloadingInfo":
            fields = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    assert fields, "CPUOffloadingInfo not found in vLLM"
    info_name = consts.get("KV_OFFLOAD_CONFIG_INFO")
    assert info_name == "vllm:kv_offload_config_info"
    out[info_name] = ("gauge", BASE + fields)
    return out


@pytest.fixture(scope="module")
def vllm_metrics(vllm_root: Path) -> dict[str, tuple[str, list[str] | None]]:
    metrics = logger_metrics(vllm_root / "v1/metrics/loggers.py")
    metrics.update(offloading_metrics(vllm_root))
    return metrics


@pytest.fixture(scope="module")
def simulator_registry():
    """The registry behind /metrics of a simulator that served traffic with host hits."""
    from spillway_cli.loadgen import TraceSpec, generate_trace, to_replay_items
    from spillway_engine.simulator.core import EngineCore, replay
    from spillway_engine.simulator.plan_input import gpu_blocks_for_tokens, load_plan
    from spillway_engine.simulator.prom import SimulatorMetrics

    plan_file = Path(__file__).parents[1] / "fixtures/plans/llama-3.2-1b-upstream.json"
    plan = load_plan(plan_file)
    core = EngineCore(plan, gpu_blocks=gpu_blocks_for_tokens(plan, 8192), seed=1)
    metrics = SimulatorMetrics(core)
    spec = TraceSpec(
        kind="shared-prefix",
        rate=5,
        num_requests=80,
        duration=None,
        prefixes=12,
        prefix_tokens=1024,
        max_tokens=8,
    )
    replay(core, to_replay_items(generate_trace(spec)))
    metrics.sync()
    assert core.counters.cached_host > 0, "the fixture traffic should hit the host pool"
    return metrics.registry


@pytest.fixture(scope="module")
def simulator_exposition(simulator_registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(simulator_registry).decode()


def _families(registry) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) as the client library defines them (no _created)."""
    out = {}
    for family in registry.collect():
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        out[family.name] = (family.type, labels)
    return out


def test_vllm_source_parsed(vllm_metrics):
    # A broken parser would make the contract vacuous: spot-check known facts.
    assert vllm_metrics["vllm:kv_cache_usage_perc"] == ("gauge", BASE)
    assert vllm_metrics["vllm:prompt_tokens_cached_by_source"] == ("counter", [*BASE, "source"])
    assert vllm_metrics["vllm:kv_offload_store_bytes"] == ("counter", BASE)
    assert vllm_metrics["vllm:kv_offload_cpu_cache_usage_perc"] == ("gauge", BASE)
    assert vllm_metrics["vllm:time_to_first_token_seconds"][0] == "histogram"
    assert len(vllm_metrics) > 40


REQUIRED = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_store_time",
    "vllm:kv_offload_load_time",
    "vllm:kv_offload_cpu_cache_usage_perc",
    "vllm:kv_offload_config_info",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
]


def test_simulator_exposes_the_required_metrics(simulator_registry, simulator_exposition):
    families = _families(simulator_registry)
    missing = [name for name in REQUIRED if name not in families]
    assert not missing, f"simulator lacks {missing}"
    # and they are in the scraped text, with vLLM's base labels
    parsed = {f.name for f in text_string_to_metric_families(simulator_exposition)}
    for name in REQUIRED:
        assert name in parsed
    assert 'model_name="meta-llama/Llama-3.2-1B"' in simulator_exposition
    assert 'engine="0"' in simulator_exposition


def test_every_vllm_metric_matches_vllm(simulator_registry, vllm_metrics):
    families = _families(simulator_registry)
    exposed = {name: v for name, v in families.items() if name.startswith("vllm:")}
    assert len(exposed) >= len(REQUIRED)
    problems = []
    for name, (kind, labels) in sorted(exposed.items()):
        if name not in vllm_metrics:
            problems.append(f"{name}: not a vLLM 0.33.0 metric")
            continue
        want_kind, want_labels = vllm_metrics[name]
        if kind != want_kind:
            problems.append(f"{name}: type {kind}, vLLM has {want_kind}")
        if want_labels is not None and labels != set(want_labels):
            problems.append(f"{name}: labels {sorted(labels)}, vLLM has {sorted(want_labels)}")
    assert not problems, "\n".join(problems)


def test_label_values_match_vllm_enumerations(simulator_exposition, vllm_root):
    """The source/reason label values are the ones vLLM enumerates."""
    text = (vllm_root / "v1/metrics/cache_hit_source.py").read_text()
    sources = {
        node.value.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    seen = set()
    for family in text_string_to_metric_families(simulator_exposition):
        if family.name == "vllm:prompt_tokens_cached_by_source":
            seen |= {s.labels["source"] for s in family.samples}
    assert seen and seen <= sources
    assert {"device", "host"} <= seen


def _bucket_defaults(root: Path) -> dict[str, tuple[float, ...]]:
    out = {}
    for node in ast.parse((root / "v1/metrics/buckets.py").read_text()).body:
        target = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        if target and target.endswith("_BUCKETS") and value is not None:
            try:
                out[target] = tuple(ast.literal_eval(value))
            except ValueError:
                continue
    return out


def test_histogram_buckets_are_vllms(vllm_root):
    from spillway_engine import metrics as prom

    vllm_buckets = _bucket_defaults(vllm_root)
    for name in (
        "REQUEST_LATENCY_BUCKETS",
        "TIME_TO_FIRST_TOKEN_BUCKETS",
        "INTER_TOKEN_LATENCY_BUCKETS",
        "REQUEST_NUM_PREEMPTIONS_BUCKETS",
    ):
        assert tuple(getattr(prom, name)) == vllm_buckets[name], name


def help_texts(root: Path) -> dict[str, str]:
    """name -> HELP text of every vLLM metric whose documentation is a string constant."""
    files = [
        root / "v1/metrics/loggers.py",
        root / "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
        *sorted((root / "v1/kv_offload").rglob("*.py")),
    ]
    consts = _string_constants(files)

    def text(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return consts.get(_dotted(node) or "") if node is not None else None

    out: dict[str, str] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):  # Gauge(name="vllm:...", documentation=...)
                kw = {k.arg: k.value for k in node.keywords if k.arg}
                name, doc = text(kw.get("name")), text(kw.get("documentation"))
                if name and doc and name.startswith("vllm:"):
                    out.setdefault(name, doc)
            if isinstance(node, ast.Dict):  # {NAME: Offloading*Metadata(documentation=...)}
                for key, value in zip(node.keys, node.values, strict=False):
                    if key is None or not isinstance(value, ast.Call):
                        continue
                    name = text(key) or consts.get((_dotted(key) or "").split(".")[-1])
                    kw = {k.arg: k.value for k in value.keywords if k.arg}
                    doc = text(kw.get("documentation"))
                    if name and doc and name.startswith("vllm:"):
                        out.setdefault(name, doc)
    return out


def test_catalogue_help_is_vllms(vllm_root, simulator_registry):
    """Each vLLM series in Spillway's catalogue carries vLLM 0.33.0's own HELP text."""
    from spillway_engine.metrics import VLLM_METRICS

    helps = help_texts(vllm_root)
    assert helps["vllm:kv_cache_usage_perc"] == "KV-cache usage. 1 means 100 percent usage."
    problems = [
        f"{m.name}: {m.help!r}, vLLM has {helps.get(m.name)!r}"
        for m in VLLM_METRICS
        if helps.get(m.name) != m.help
    ]
    assert not problems, "\n".join(problems)
    exposed = {f.name: f.documentation for f in simulator_registry.collect()}
    for m in VLLM_METRICS:
        assert exposed[m.name] == m.help
