"""`spillway-engine serve` and the start-up plan check against vLLM 0.33.0 itself.

(a) The command the launcher prints is one vLLM accepts: its own `vllm serve` parser
    reads every flag, and the `--kv-transfer-config` JSON, parsed into vLLM's
    `KVTransferConfig` and put on a real `VllmConfig` of the same model, goes through
    `build_offloading_config` and the offloading spec factory to the plan's figures.
(b) The plan check, fed vLLM's real `VllmConfig`/`KVCacheConfig`, passes a right plan
    and catches wrong page bytes and wrong blocks per chunk.
(c) The plugin: vLLM's loader finds it from the proposed entry-point line; the hook on
    `Executor.initialize_from_config` stops a wrong plan before the workers are asked to
    allocate; vLLM's Prometheus stat logger comes up with Spillway's plan metrics.

Models: Gemma 3 (six sliding-window groups + one full), Llama 3.2 (one group),
Qwen3-Next (GDN/Mamba + full attention). Layouts are built once per session
(conftest's ``vllm_layouts``, shared with the planner contract).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.plugins import load_plugins_by_group
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.loggers import PrometheusStatLogger

from spillway_engine import cli
from spillway_engine.launcher import plan_check, plugin, serve
from spillway_engine.launcher.plan_check import PlanMismatch
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan
from spillway_engine.seam import EngineOptions

from .conftest import LayoutCache, load_model
from .vllm_harness import Case, VllmLayout
from .vllm_harness import _write_config as write_model_dir

GIB = 2**30
POOL = 8 * GIB

CASES = [
    Case("gemma-3-1b-it"),
    Case("llama-3.2-1b"),
    Case("qwen3-next-80b-a3b-instruct"),
]
OFFLOADERS = ["upstream", "spillway"]
OPTIONS = EngineOptions(model="org/model", served_model_name="served", eviction_policy="lru")


def plan_for(case: Case, offloader: str) -> Plan:
    return make_plan(
        load_model(case.model),
        PlanRequest(
            model_name=case.model,
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            max_model_len=case.max_model_len,
            cpu_memory_bytes=POOL,
            offloader=offloader,
        ),
    )


def altered(plan: Plan, change: Any) -> Plan:
    """A copy of ``plan`` with ``change(data)`` applied to its JSON object."""
    data = plan.model_dump(mode="json")
    change(data)
    return Plan.model_validate(data)


def layout_for(cache: LayoutCache, case: Case, plan: Plan) -> VllmLayout:
    built = cache.get(case, plan.gpu.attention_backend)
    if isinstance(built, Exception):
        pytest.fail(f"vLLM could not build {case}: {built!r}")
    return built


@contextmanager
def serving(layout: VllmLayout, transfer: dict[str, Any]) -> Iterator[Any]:
    """The shared VllmConfig with vLLM's own parse of ``transfer`` installed."""
    vc = layout.vllm_config
    saved = vc.kv_transfer_config
    vc.kv_transfer_config = KVTransferConfig(**transfer)
    try:
        yield vc
    finally:
        vc.kv_transfer_config = saved


def dry_run(tmp_path: Path, plan: Plan, capsys, weights: str | None = None) -> list[str]:
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    options = {"model": "org/model", "served_model_name": "served", "weights_path": weights}
    (tmp_path / "engine.json").write_text(json.dumps(options))
    code = cli.main(["serve", "--plan", str(tmp_path / "plan.json"), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""  # no notes: the plan is served as it is
    return shlex.split(out)


def kv_transfer_json(cmd: list[str]) -> dict[str, Any]:
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


# --------------------------------------------------------------- (a) the command


@pytest.fixture(scope="session")
def serve_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dry_run_command_parses_with_vllm_serve(case: Case, serve_parser, tmp_path, capsys):
    plan = plan_for(case, "spillway")
    # the engine's KV events are on by default, so its stores are vLLM's self-describing ones
    extra = {**plan.spillway.kv_connector_extra_config, "self_describing_kv_events": True}
    weights = write_model_dir(load_model(case.model))  # the pod's weights_path, config only
    cmd = dry_run(tmp_path, plan, capsys, weights=weights)
    assert cmd[:3] == ["vllm", "serve", weights]
    args = serve_parser.parse_args(cmd[1:])
    assert args.model_tag == weights
    assert args.served_model_name == ["served"]
    assert args.tensor_parallel_size == case.tensor_parallel_size
    assert args.pipeline_parallel_size == 1 and args.data_parallel_size == 1
    assert args.max_model_len == case.max_model_len == plan.max_model_len
    assert args.kv_cache_dtype == "auto" and args.dtype == plan.model.dtype
    assert args.enable_prefix_caching is True
    assert args.block_size is None  # vLLM chooses the planned size itself
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    transfer = args.kv_transfer_config
    assert isinstance(transfer, KVTransferConfig)
    assert transfer.kv_connector == "SpillwayOffloadingConnector"
    assert transfer.kv_connector_module_path == "spillway_engine.offloader"
    assert transfer.kv_role == "kv_both"
    assert transfer.kv_connector_extra_config == extra
    # what `vllm serve` does next: engine args -> VllmConfig, from exactly this command
    args.model = args.model_tag
    vc = EngineArgs.from_cli_args(args).create_engine_config()
    assert vc.model_config.max_model_len == plan.max_model_len
    assert str(vc.model_config.dtype) == f"torch.{plan.model.dtype}"
    assert vc.model_config.served_model_name == "served"
    assert vc.parallel_config.tensor_parallel_size == case.tensor_parallel_size
    assert vc.cache_config.enable_prefix_caching is True
    assert vc.cache_config.cache_dtype == "auto"
    assert vc.kv_transfer_config.kv_connector == "SpillwayOffloadingConnector"
    assert vc.kv_transfer_config.kv_connector_module_path == "spillway_engine.offloader"
    assert vc.kv_transfer_config.kv_connector_extra_config == extra


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dry_run_transfer_config_is_accepted_by_vllm(
    case: Case, vllm_layouts: LayoutCache, tmp_path, capsys
):
    """An upstream plan's transfer config through vLLM's own offloading config."""
    plan = plan_for(case, "upstream")
    layout = layout_for(vllm_layouts, case, plan)
    transfer = kv_transfer_json(dry_run(tmp_path, plan, capsys))
    assert transfer["kv_connector"] == "OffloadingConnector"
    upstream = plan.upstream
    assert (upstream.blocks_per_chunk, upstream.row_bytes, upstream.num_chunks) == (
        plan.blocks_per_chunk,
        plan.row_bytes,
        plan.num_chunks,
    )
    with serving(layout, transfer) as vc:
        off = build_offloading_config(vc, layout.kv_cache_config)
        spec = OffloadingSpecFactory.create_spec(off)
        manager = spec.get_manager()
    assert isinstance(spec, CPUOffloadingSpec)
    assert isinstance(manager, CPUOffloadingManager)
    assert off.cache.blocks_per_chunk == upstream.blocks_per_chunk
    assert off.cache.tokens_per_hash == plan.tokens_per_hash
    assert off.worker_kv_bytes_per_block == plan.worker_bytes_per_block
    assert [g.tokens_per_block for g in off.groups] == [
        g.tokens_per_block for g in plan.kv_groups
    ]
    assert (spec.kv_bytes_per_chunk, spec.num_chunks) == (
        upstream.row_bytes,
        upstream.num_chunks,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dry_run_spillway_transfer_config_builds_the_planned_geometry(
    case: Case, vllm_layouts: LayoutCache, tmp_path, capsys
):
    """A spillway plan's transfer config through Spillway's connector geometry."""
    from spillway_engine.offloader.geometry import build_geometry

    plan = plan_for(case, "spillway")
    layout = layout_for(vllm_layouts, case, plan)
    transfer = kv_transfer_json(dry_run(tmp_path, plan, capsys))
    assert transfer["kv_connector"] == "SpillwayOffloadingConnector"
    with serving(layout, transfer) as vc:
        host = build_geometry(vc, layout.kv_cache_config).layout
    spillway = plan.spillway
    assert host.chunk_tokens == spillway.chunk_tokens
    assert [g.blocks_per_chunk for g in host.groups] == [
        g.blocks_per_chunk for g in spillway.groups
    ]
    assert [g.units for g in host.groups] == [g.units for g in spillway.groups]
    assert host.unit_bytes == spillway.unit_bytes
    assert host.num_units == spillway.num_units > 0


# ----------------------------------------------------------- (b) the plan check


@pytest.mark.parametrize("offloader", OFFLOADERS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_check_passes_the_right_plan(case: Case, offloader: str, vllm_layouts):
    plan = plan_for(case, offloader)
    layout = layout_for(vllm_layouts, case, plan)
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    with serving(layout, transfer) as vc:
        observed = plan_check.check(plan, vc, layout.kv_cache_config)
    assert [g.kind for g in observed.groups] == [g.kind for g in plan.kv_groups]
    assert observed.cpu_bytes_to_use == POOL
    if offloader == "spillway":
        spillway = plan.spillway
        assert observed.kv_connector == "SpillwayOffloadingConnector"
        assert observed.chunk_tokens == spillway.chunk_tokens
        assert list(observed.group_units) == [g.units for g in spillway.groups]
        assert observed.num_units == spillway.num_units > 0
        assert observed.num_chunks is None  # vLLM's offloading spec is not involved
    else:
        assert observed.kv_connector == "OffloadingConnector"
        assert observed.num_chunks == plan.num_chunks == plan.upstream.num_chunks > 0
        assert observed.blocks_per_chunk == plan.upstream.blocks_per_chunk
        assert observed.num_units is None


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_check_catches_wrong_page_bytes(case: Case, vllm_layouts):
    plan = plan_for(case, "upstream")
    layout = layout_for(vllm_layouts, case, plan)
    last = len(plan.kv_groups) - 1
    real_page = plan.kv_groups[last].page_bytes
    wrong = altered(plan, lambda d: d["kv_groups"][last].update(page_bytes=real_page // 2))
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(wrong, vc, layout.kv_cache_config)
    found = {m.field: (m.plan, m.vllm) for m in e.value.mismatches}
    assert found[f"kv_groups[{last}].page_bytes"] == (real_page // 2, real_page)
    assert "page_bytes" in str(e.value) and "refusing to serve" in str(e.value)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_check_catches_wrong_blocks_per_chunk(case: Case, vllm_layouts):
    plan = plan_for(case, "upstream")
    layout = layout_for(vllm_layouts, case, plan)
    bpc = plan.upstream.blocks_per_chunk
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    # vLLM is started with another chunk size than the pod was sized for
    transfer["kv_connector_extra_config"]["blocks_per_chunk"] = bpc * 2
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(plan, vc, layout.kv_cache_config)
    found = {m.field: (m.plan, m.vllm) for m in e.value.mismatches}
    assert found["blocks_per_chunk"] == (bpc, bpc * 2)
    assert found["row_bytes"][0] == plan.upstream.row_bytes < found["row_bytes"][1]
    assert found["num_chunks"][0] == plan.upstream.num_chunks > found["num_chunks"][1]
    assert set(found) == {"blocks_per_chunk", "row_bytes", "num_chunks"}
    # and the other way round: a plan that says another bpc than vLLM runs
    wrong = altered(plan, lambda d: d["upstream"].update(blocks_per_chunk=bpc + 1))
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(wrong, vc, layout.kv_cache_config)
    assert [m.field for m in e.value.mismatches] == ["blocks_per_chunk"]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_spillway_plan_runs_spillways_connector_as_planned(case: Case, vllm_layouts):
    plan = plan_for(case, "spillway")
    layout = layout_for(vllm_layouts, case, plan)
    transfer, notes = serve.transfer_config(plan, OPTIONS)
    assert transfer["kv_connector"] == "SpillwayOffloadingConnector", notes
    with serving(layout, transfer) as vc:
        connector_cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
        observed = plan_check.check(plan, vc, layout.kv_cache_config)
    assert connector_cls.__name__ == "SpillwayOffloadingConnector"
    assert issubclass(connector_cls, SupportsHMA)
    spillway = plan.spillway
    assert observed.chunk_tokens == spillway.chunk_tokens
    assert list(observed.group_units) == [g.units for g in spillway.groups]
    assert observed.num_units == spillway.num_units > 0


def test_plan_check_catches_a_spillway_pool_other_than_planned(vllm_layouts):
    case = CASES[0]
    plan = plan_for(case, "spillway")
    layout = layout_for(vllm_layouts, case, plan)
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] = POOL * 2
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(plan, vc, layout.kv_cache_config)
    found = {m.field: (m.plan, m.vllm) for m in e.value.mismatches}
    assert set(found) == {"cpu_bytes_to_use", "spillway.num_units"}
    units = plan.spillway.num_units
    assert found["spillway.num_units"] == (units, units * 2)
    # an engine cut into other chunks than the plan's is refused by the connector itself
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    transfer["kv_connector_extra_config"]["spillway_chunk_tokens"] = 512
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(plan, vc, layout.kv_cache_config)
    [m] = e.value.mismatches
    assert m.field == "offloading config" and "the plan cuts 16 blocks per chunk" in m.vllm


def test_plan_check_reports_vllm_refusing_the_chunk_size(vllm_layouts):
    case = CASES[0]
    plan = plan_for(case, "upstream")
    layout = layout_for(vllm_layouts, case, plan)
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    transfer["kv_connector_extra_config"] = {"cpu_bytes_to_use": POOL, "blocks_per_chunk": 0}
    with serving(layout, transfer) as vc, pytest.raises(PlanMismatch) as e:
        plan_check.check(plan, vc, layout.kv_cache_config)
    [m] = e.value.mismatches
    assert m.field == "offloading config" and "greater than 0" in m.vllm


# --------------------------------------------------------------- (c) the plugin


def test_vllm_loads_the_plugin_from_the_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "spillway_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spillway-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{plugin.ENTRY_POINT_GROUP}]\n"
        f"{plugin.ENTRY_POINT_NAME} = {plugin.ENTRY_POINT_VALUE}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins = load_plugins_by_group(plugin.ENTRY_POINT_GROUP)
    assert plugins[plugin.ENTRY_POINT_NAME] is plugin.register


def test_plugin_without_a_plan_registers_only_the_connector(monkeypatch):
    """vLLM runs the plugin in every process, with or without Spillway's launcher:
    without ``SPILLWAY_PLAN`` it registers the connector and installs no hook."""
    monkeypatch.delenv(plugin.ENV_PLAN, raising=False)
    monkeypatch.setitem(plugin._state, "plan", None)
    monkeypatch.setattr(Executor, "initialize_from_config", Executor.initialize_from_config)
    monkeypatch.setattr(PrometheusStatLogger, "__init__", PrometheusStatLogger.__init__)
    plugin.register()
    assert plugin._state["plan"] is None
    assert not getattr(Executor.initialize_from_config, "_spillway_checked", False)
    assert not getattr(PrometheusStatLogger.__init__, "_spillway_metrics", False)
    connector = KVConnectorFactory.get_connector_class_by_name("SpillwayOffloadingConnector")
    assert connector.__name__ == "SpillwayOffloadingConnector"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read the plan"),
        ("{}", "is missing vllm_version, spillway_version"),
        ("other-vllm", "for vLLM 0.32.0; this engine is Spillway"),
    ],
)
def test_plugin_stops_vllm_on_a_plan_it_cannot_use(monkeypatch, tmp_path, content, match):
    path = tmp_path / "plan.json"
    if content == "other-vllm":
        data = plan_for(CASES[1], "upstream").model_dump(mode="json")
        content = json.dumps({**data, "vllm_version": "0.32.0"})
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(plugin.ENV_PLAN, str(path))
    monkeypatch.setitem(plugin._state, "plan", None)
    monkeypatch.setattr(Executor, "initialize_from_config", Executor.initialize_from_config)
    with pytest.raises(plugin.PluginError) as e:
        plugin.register()
    assert match in str(e.value) and "\n" not in str(e.value)
    assert plugin._state["plan"] is None
    assert not getattr(Executor.initialize_from_config, "_spillway_checked", False)


_FRESH_PROCESS = """
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor.abstract import Executor
from vllm.v1.metrics.loggers import PrometheusStatLogger

EngineArgs(model=sys.argv[1], skip_tokenizer_init=True)  # vLLM's first plugin call
from spillway_engine.launcher import plugin
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

print(json.dumps({
    "plan": plugin._state["plan"].model.name,
    "connector": KVConnectorFactory.get_connector_class_by_name(
        "SpillwayOffloadingConnector"
    ).__name__,
    "check": getattr(Executor.initialize_from_config, "_spillway_checked", False),
    "metrics": getattr(PrometheusStatLogger.__init__, "_spillway_metrics", False),
}))
"""


def test_plugin_activates_in_a_fresh_vllm_process(tmp_path):
    """In a new process, vLLM's own first plugin call registers the connector and
    installs both hooks (no import cycle at that point of vLLM's start-up)."""
    dist = tmp_path / "spillway_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spillway-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{plugin.ENTRY_POINT_GROUP}]\n"
        f"{plugin.ENTRY_POINT_NAME} = {plugin.ENTRY_POINT_VALUE}\n"
    )
    plan = plan_for(CASES[1], "upstream")
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    engine_dir = Path(plugin.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(engine_dir)]),
        "SPILLWAY_PLAN": str(tmp_path / "plan.json"),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VLLM_PLUGINS", None)
    model_dir = write_model_dir(load_model(CASES[1].model))
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "plan": CASES[1].model,
        "connector": "SpillwayOffloadingConnector",  # registered by name, in every process
        "check": True,
        "metrics": True,
    }


class RecordingExecutor(Executor):
    """An executor whose workers only record what they are asked to do."""

    def _init_executor(self) -> None:
        self.calls: list[str] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
        self.calls.append(method if isinstance(method, str) else method.__name__)
        return []

    def check_health(self) -> None:
        return None


@pytest.fixture
def plugin_with(monkeypatch, tmp_path):
    """Run the plugin entry as vLLM would, with a given plan; undo its patches after."""
    monkeypatch.setattr(Executor, "initialize_from_config", Executor.initialize_from_config)
    monkeypatch.setattr(PrometheusStatLogger, "__init__", PrometheusStatLogger.__init__)
    monkeypatch.setitem(plugin._state, "plan", None)
    monkeypatch.setitem(plugin._state, "metrics", {})

    def activate(plan: Plan) -> None:
        path = tmp_path / "plan.json"
        path.write_text(plan.model_dump_json())
        monkeypatch.setenv(plugin.ENV_PLAN, str(path))
        plugin.register()
        plugin.register()  # idempotent: vLLM calls it in every process, maybe twice

    yield activate
    for metrics in plugin._state["metrics"].values():
        # the dynamic families are absent where Spillway's connector exports them
        for family in (
            metrics.capacity_chunks,
            metrics.capacity_tokens,
            *metrics.dynamic_families,
            metrics.plan_info,
        ):
            REGISTRY.unregister(family)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("case", CASES[::2], ids=str)
def test_hook_stops_a_wrong_plan_before_the_workers_allocate(
    case: Case, vllm_layouts, plugin_with, monkeypatch
):
    plan = plan_for(case, "spillway")
    layout = layout_for(vllm_layouts, case, plan)
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    assert transfer["kv_connector"] == "SpillwayOffloadingConnector"
    records = Records()
    logger = logging.getLogger("vllm.spillway")
    logger.addHandler(records)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        wrong = plan.model_copy(update={"tokens_per_hash": plan.tokens_per_hash * 2})
        plugin_with(wrong)
        assert getattr(Executor.initialize_from_config, "_spillway_checked", False)
        with serving(layout, transfer) as vc:
            executor = RecordingExecutor(vc)
            with pytest.raises(PlanMismatch):
                executor.initialize_from_config([layout.kv_cache_config])
            assert executor.calls == []  # the workers were never told to allocate
            table = records.messages[-1]
            assert "plan check FAILED" in table
            assert "tokens_per_hash" in table and "field" in table and "vLLM" in table

            monkeypatch.setitem(plugin._state, "plan", plan)
            executor.initialize_from_config([layout.kv_cache_config])
            assert executor.calls == ["initialize_from_config"]
            assert "plan check passed" in records.messages[-1]
    finally:
        logger.removeHandler(records)


def plan_info_samples() -> list[Any]:
    return [
        s
        for family in REGISTRY.collect()
        if family.name == "spillway_plan_info"
        for s in family.samples
    ]


def stat_logger_for(
    offloader: str, vllm_layouts: LayoutCache, plugin_with: Any
) -> tuple[Plan, dict[str, str]]:
    """Build vLLM's stat logger with the plugin active for a plan; its metric labels."""
    case = CASES[0]
    plan = plan_for(case, offloader)
    layout = layout_for(vllm_layouts, case, plan)
    transfer, _ = serve.transfer_config(plan, OPTIONS)
    plugin_with(plan)
    with serving(layout, transfer) as vc:
        PrometheusStatLogger(vc, [0])
        served = str(vc.model_config.served_model_name)
    return plan, {"model_name": served, "engine": "0"}


def test_stat_logger_exports_the_plan_metrics(vllm_layouts, plugin_with):
    plan, labels = stat_logger_for("upstream", vllm_layouts, plugin_with)
    # served with vLLM's offloader, the pool is the plan's upstream one
    assert REGISTRY.get_sample_value("spillway_host_pool_capacity_chunks", labels) == (
        plan.upstream.num_chunks
    )
    assert REGISTRY.get_sample_value("spillway_host_pool_capacity_tokens", labels) == (
        plan.upstream.capacity_tokens
    )
    # vLLM's connector has no pool series of its own: the plugin exports them at zero
    assert REGISTRY.get_sample_value("spillway_host_pool_used_chunks", labels) == 0
    info = plan_info_samples()
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["offloader"] == "upstream"
    assert info[0].labels["num_groups"] == str(len(plan.kv_groups))
    # vLLM's own metrics are there too, on the same registry
    assert any(f.name.startswith("vllm:") for f in REGISTRY.collect())


def test_stat_logger_leaves_the_pool_series_to_spillways_connector(vllm_layouts, plugin_with):
    plan, labels = stat_logger_for("spillway", vllm_layouts, plugin_with)
    [metrics] = plugin._state["metrics"].values()
    assert metrics.dynamic_families == []  # the connector's own metrics export those
    assert REGISTRY.get_sample_value("spillway_host_pool_capacity_chunks", labels) == (
        plan.num_chunks
    )
    assert REGISTRY.get_sample_value("spillway_host_pool_capacity_tokens", labels) == (
        plan.capacity_tokens
    )
    info = plan_info_samples()
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["offloader"] == "spillway"
    assert info[0].labels["num_groups"] == str(len(plan.kv_groups))
