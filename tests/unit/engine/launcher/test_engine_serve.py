"""`spillway-engine serve`: the vLLM command built from a plan, refusals, exit codes;
the plan reader's refusals; the pure half of the start-up plan check; the plugin's
plan file and plan metrics. Nothing here needs vLLM or torch (the plugin's vLLM half
is in tests/contract/test_engine_contract.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import spillway_engine
from spillway_engine.cli import main
from spillway_engine.emulator import launch as emulated
from spillway_engine.launcher import plugin, serve
from spillway_engine.launcher.plan_check import (
    Mismatch,
    ObservedGeometry,
    ObservedGroup,
    PlanMismatch,
    compare,
    effective_plan,
    format_table,
)
from spillway_engine.launcher.serve import EngineCliError, build_command
from spillway_engine.planner.plan import Plan, PlanReadError, PlanRequest, make_plan, read_plan
from spillway_engine.seam import EngineOptions
from spillway_engine.vllm_pins import VLLM_VERSION
from tests.unit.planner_fixtures import load_model

GIB = 2**30

GEMMA = "gemma-3-1b-it"  # 6 sliding-window groups + 1 full-attention group
LLAMA = "llama-3.2-1b"  # one full-attention group
QWEN_NEXT = "qwen3-next-80b-a3b-instruct"  # GDN (Mamba) hybrid: 3 Mamba + 1 attention
NEMOTRON = "nemotron-h-8b-base-8k"  # Mamba2 hybrid


@pytest.fixture(autouse=True)
def pod_host(tmp_path, monkeypatch) -> Path:
    """The pod's host facts in tmp: shm folder, memory cgroup (no limit) and the
    termination log, so no test frees the machine's /dev/shm or writes /dev."""
    host = tmp_path / "host"
    (host / "shm").mkdir(parents=True)
    (host / "cgroup").mkdir()
    monkeypatch.setenv("SPILLWAY_SHM_DIR", str(host / "shm"))
    monkeypatch.setenv("SPILLWAY_CGROUP_ROOT", str(host / "cgroup"))
    monkeypatch.setenv("SPILLWAY_TERMINATION_LOG", str(host / "termination-log"))
    return host


def plan_for(model: str, **kw: Any) -> Plan:
    kw.setdefault("cpu_memory_bytes", 8 * GIB)
    kw.setdefault("max_model_len", 8192)
    return make_plan(load_model(model), PlanRequest(model_name=model, **kw))


def without_upstream(plan: Plan, refusal: str) -> Plan:
    """The plan as made for a model vLLM's own offloader refuses."""
    return plan.model_copy(update={"upstream": None, "upstream_refusal": refusal})


OPTIONS = EngineOptions(
    model="org/model",
    revision="abc123",
    served_model_name="served",
    gpu_memory_utilization=0.9,
    dtype="auto",
    eviction_policy="lru",
    extra_args=("--max-num-seqs", "64"),
)


def flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, f"{name} appears {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


def transfer(cmd: list[str]) -> dict[str, Any]:
    return json.loads(flag(cmd, "--kv-transfer-config"))


# ---------------------------------------------------------------- command building


@pytest.mark.parametrize("model", [GEMMA, LLAMA, QWEN_NEXT, NEMOTRON])
@pytest.mark.parametrize("offloader", ["upstream", "spillway"])
def test_command_carries_the_plan(model: str, offloader: str):
    plan = plan_for(model, offloader=offloader, tensor_parallel_size=2)
    cmd, notes = build_command(plan, OPTIONS)
    assert notes == []
    assert cmd[:3] == ["vllm", "serve", "org/model"]
    assert flag(cmd, "--served-model-name") == "served"
    assert flag(cmd, "--revision") == "abc123"
    assert flag(cmd, "--tensor-parallel-size") == "2"
    assert flag(cmd, "--pipeline-parallel-size") == "1"
    assert flag(cmd, "--data-parallel-size") == "1"
    assert flag(cmd, "--max-model-len") == "8192"
    assert flag(cmd, "--gpu-memory-utilization") == "0.9"
    assert flag(cmd, "--dtype") == plan.model.dtype == "bfloat16"
    assert flag(cmd, "--kv-cache-dtype") == "auto"
    assert "--enable-prefix-caching" in cmd and "--disable-prefix-caching" not in cmd
    assert "--block-size" not in cmd  # nobody forced one: vLLM picks the plan's size
    assert cmd[-6:] == ["--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "64"]
    kv = transfer(cmd)
    assert kv["kv_role"] == "kv_both"
    assert "block_size" not in kv["kv_connector_extra_config"]
    if offloader == "spillway":
        # Spillway's connector, exactly as planned
        assert kv["kv_connector"] == "SpillwayOffloadingConnector"
        assert kv["kv_connector_module_path"] == "spillway_engine.offloader"
        assert kv["kv_connector_extra_config"] == {
            **plan.spillway.kv_connector_extra_config,
            "eviction_policy": "lru",
            "self_describing_kv_events": True,  # KV events are on
        }
        assert "blocks_per_chunk" not in kv["kv_connector_extra_config"]
    else:
        # vLLM's own connector with the plan's (upstream) figures
        assert kv["kv_connector"] == "OffloadingConnector"
        assert "kv_connector_module_path" not in kv
        assert plan.upstream is not None
        assert kv["kv_connector_extra_config"] == {
            **plan.upstream.kv_connector_extra_config,
            "eviction_policy": "lru",
            "self_describing_kv_events": True,
        }
        assert (
            kv["kv_connector_extra_config"]["blocks_per_chunk"]
            == plan.blocks_per_chunk
            == plan.upstream.blocks_per_chunk
        )


def test_spillway_plan_serves_spillways_offloader():
    plan = plan_for(GEMMA)
    assert plan.offloader == "spillway"  # the planner's default
    cmd, notes = build_command(plan, OPTIONS)
    kv = transfer(cmd)
    assert kv["kv_connector"] == "SpillwayOffloadingConnector"
    assert kv["kv_connector_module_path"] == "spillway_engine.offloader"
    extra = kv["kv_connector_extra_config"]
    assert extra["spillway_chunk_tokens"] == plan.spillway.chunk_tokens
    assert extra["spillway_group_blocks_per_chunk"] == [16] * 7
    assert extra["cpu_bytes_to_use"] == 8 * GIB
    assert notes == []


def test_spillway_plan_that_upstream_refuses_is_still_served():
    """vLLM's own offloader refusing the model does not matter: Spillway's serves it."""
    plan = without_upstream(
        plan_for(GEMMA), "group 2 has 8 tokens per block, not a multiple of 16"
    )
    cmd, notes = build_command(plan, OPTIONS)
    kv = transfer(cmd)
    assert kv["kv_connector"] == "SpillwayOffloadingConnector"
    assert kv["kv_connector_module_path"] == "spillway_engine.offloader"
    assert kv["kv_connector_extra_config"] == {
        **plan.spillway.kv_connector_extra_config,
        "eviction_policy": "lru",
        "self_describing_kv_events": True,
    }
    assert notes == []


def test_token_based_chunk_size_is_passed_as_blocks_per_chunk():
    """The legacy token-based chunk key is planned into blocks per chunk: vLLM gets the
    blocks, never the token key that fails once groups differ in tokens per block."""
    plan = plan_for(LLAMA, offloader="upstream", chunk_block_size_tokens=64)
    extra = transfer(build_command(plan, OPTIONS)[0])["kv_connector_extra_config"]
    assert "block_size" not in extra
    assert extra["blocks_per_chunk"] == 64 // plan.kv_groups[0].tokens_per_block == 4


def test_forced_block_size_is_passed():
    assert flag(build_command(plan_for(LLAMA, block_size=32), OPTIONS)[0], "--block-size") == "32"
    # FlashMLA's fixed 64-token kernel blocks are its own choice, not a forced size
    fp8 = plan_for("deepseek-v2-lite", kv_cache_dtype="fp8")
    assert fp8.block_size == 64 and fp8.gpu.attention_backend == "FLASHMLA"
    cmd, _ = build_command(fp8, OPTIONS)
    assert "--block-size" not in cmd
    assert flag(cmd, "--kv-cache-dtype") == "fp8"
    # a hybrid's raised size is vLLM's own alignment
    hybrid = plan_for(QWEN_NEXT)
    assert hybrid.block_size > 16 and hybrid.mamba_cache_mode is not None
    assert "--block-size" not in build_command(hybrid, OPTIONS)[0]


def test_prefix_caching_off_is_spelled_out():
    cmd, _ = build_command(plan_for(LLAMA, enable_prefix_caching=False), OPTIONS)
    assert "--disable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd


def test_weights_path_replaces_model_and_revision():
    options = EngineOptions(model="org/model", revision="abc", weights_path="/weights/m")
    cmd, _ = build_command(plan_for(LLAMA), options)
    assert cmd[2] == "/weights/m"
    assert "--revision" not in cmd
    assert flag(cmd, "--served-model-name") == "org/model"
    assert "--gpu-memory-utilization" not in cmd


def test_offload_disabled_drops_the_connector():
    options = EngineOptions(model="m", offload_enabled=False)
    cmd, notes = build_command(plan_for(GEMMA), options)
    assert "--kv-transfer-config" not in cmd
    assert "disabled" in notes[0]


def test_dtype_conflict_is_refused():
    with pytest.raises(EngineCliError, match="float16 disagrees"):
        build_command(plan_for(LLAMA), EngineOptions(model="m", dtype="float16"))
    cmd, _ = build_command(plan_for(LLAMA, dtype="float16"), EngineOptions(model="m"))
    assert flag(cmd, "--dtype") == "float16"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
        (["--tensor_parallel_size=2"], "--tensor-parallel-size"),
        (["-tp", "2"], "-tp (--tensor-parallel-size)"),
        (["-tp2"], "-tp (--tensor-parallel-size)"),
        (["-pp", "2"], "-pp (--pipeline-parallel-size)"),
        (["--data-parallel-size", "2"], "--data-parallel-size"),
        (["-dpl", "2"], "-dpl (--data-parallel-size-local)"),
        (["--max-model-len=4096"], "--max-model-len"),
        (["--max-model", "4096"], "--max-model-len"),  # argparse would expand the prefix
        (["--kv-transfer-config", "{}"], "--kv-transfer-config"),
        (["--kv-transfer-config.kv_connector", "X"], "--kv-transfer-config"),
        (["--kv-offloading-size", "8"], "--kv-offloading-size"),
        (["--kv-offloading-backend", "native"], "--kv-offloading-backend"),
        (["--block-size", "32"], "--block-size"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--enable-prefix-caching"], "--enable-prefix-caching"),
        (["--no-enable-prefix-caching"], "--enable-prefix-caching"),
        (["--disable-prefix-caching"], "--disable-prefix-caching"),
        (["--disable-hybrid-kv-cache-manager"], "--disable-hybrid-kv-cache-manager"),
        (["--mamba-ssm-cache-dtype", "float32"], "--mamba-ssm-cache-dtype"),
        (["--speculative-config", "{}"], "--speculative-config"),
        (["--port", "9000"], "--port"),
        (["--host", "::"], "--host"),
        (["--config", "x.yaml"], "--config"),
        (["--served-model-name", "x"], "--served-model-name"),
    ],
)
def test_plan_owned_extra_args_are_refused(args: list[str], named: str):
    with pytest.raises(EngineCliError) as e:
        build_command(plan_for(LLAMA), EngineOptions(model="m", extra_args=tuple(args)))
    assert f"is refused: {named} is set by" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args",
    [
        ["--max-num-seqs", "64"],
        ["--max-num-batched-tokens=8192"],
        ["--enable-chunked-prefill"],
        ["--kv-cache-metrics"],
        ["--kv-events-config", '{"enable_kv_cache_events": true}'],
        ["--model-impl", "vllm"],
        ["--data-parallel-rank", "0"],
        ["-O3"],
        ["--seed", "-1"],
    ],
)
def test_other_extra_args_pass_through(args: list[str]):
    cmd, _ = build_command(plan_for(LLAMA), EngineOptions(model="m", extra_args=tuple(args)))
    assert cmd[-len(args) :] == args


# --------------------------------------------------------------------- main(argv)


def write(tmp_path: Path, plan: Any, options: Any = None, name: str = "plan.json") -> Path:
    path = tmp_path / name
    if isinstance(plan, Plan):
        plan = plan.model_dump_json(indent=2)
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    if options is not None:
        (tmp_path / "engine.json").write_text(
            options if isinstance(options, str) else json.dumps(options)
        )
    return path


ENGINE_JSON = {
    "model": "google/gemma-3-1b-it",
    "revision": None,
    "served_model_name": "gemma",
    "weights_path": None,
    "gpu_memory_utilization": 0.85,
    "dtype": "auto",
    "eviction_policy": "arc",
    "offload_enabled": True,
    "extra_args": ["--max-num-seqs", "32"],
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_the_exact_command(tmp_path, capsys):
    plan = plan_for(GEMMA)
    path = write(tmp_path, plan, ENGINE_JSON)
    code, out, err = run(capsys, "serve", "--plan", str(path), "--port", "9000", "--dry-run")
    assert code == 0
    expected, _ = build_command(
        plan, serve.load_engine_options(tmp_path / "engine.json"), port=9000
    )
    assert shlex.split(out) == expected
    assert out.count("\n") == 1
    assert transfer(expected)["kv_connector"] == "SpillwayOffloadingConnector"
    assert transfer(expected)["kv_connector_extra_config"]["eviction_policy"] == "arc"
    assert flag(expected, "--gpu-memory-utilization") == "0.85"
    assert err == ""  # nothing to note: the plan is served as it is


def test_engine_options_flag_overrides_the_neighbour(tmp_path, capsys):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "x/y", "offload_enabled": False}))
    code, out, _ = run(
        capsys, "serve", "--plan", str(path), "--engine-options", str(other), "--dry-run"
    )
    assert code == 0
    assert shlex.split(out)[2] == "x/y" and "--kv-transfer-config" not in out


def test_trailing_args_after_double_dash(tmp_path, capsys):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    code, out, _ = run(capsys, "serve", "--plan", str(path), "--dry-run", "--", "--seed", "3")
    assert code == 0 and shlex.split(out)[-2:] == ["--seed", "3"]
    code, _, err = run(capsys, "serve", "--plan", str(path), "--dry-run", "--", "-tp", "4")
    assert code == 2 and "-tp" in err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("spillway-engine: error: ")
    return lines[0]


def plan_data(**changes: Any) -> dict[str, Any]:
    """A real plan's JSON object with top-level fields replaced (None: dropped)."""
    data = plan_for(LLAMA, offloader="upstream").model_dump(mode="json")
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


OURS = spillway_engine.__version__
OTHER_VLLM = plan_data(vllm_version="0.32.0")
OTHER_SPILLWAY = plan_data(spillway_version="0.0.9")


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (None, "does not exist"),
        ("{not json", "is not valid JSON: key must be a string at line 1 column 2"),
        ("[1, 2]", "is not a JSON object"),
        (
            {"vllm_version": VLLM_VERSION},
            "is missing spillway_version, gpu, model, parallelism, kv_cache_dtype,",
        ),
        (
            OTHER_VLLM,
            f"was made by Spillway {OURS} for vLLM 0.32.0; this engine is Spillway {OURS} "
            f"with vLLM {VLLM_VERSION}",
        ),
        (OTHER_SPILLWAY, "was made by Spillway 0.0.9 for vLLM"),
        # another release is named as such even where its plans have other fields
        ({**OTHER_SPILLWAY, "kv_groups": "renamed"}, "was made by Spillway 0.0.9"),
        (plan_data(kv_groups=[]), "has no kv_groups"),
        (plan_data(kv_transfer_config=None), "is missing kv_transfer_config"),
        (plan_data(num_chunks="many"), ": num_chunks: Input should be a valid integer"),
    ],
)
def test_bad_plans_exit_2_with_one_line(tmp_path, capsys, plan, match):
    path = tmp_path / "plan.json" if plan is None else write(tmp_path, plan)
    (tmp_path / "engine.json").write_text(json.dumps({"model": "m"}))
    code, out, err = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert match in line
    if plan is not None:
        assert f"plan {path}" in line  # the file is named


# ------------------------------------------------------------------ the plan reader


def test_reader_round_trips_what_the_planner_makes():
    plan = plan_for(GEMMA, tensor_parallel_size=2)
    assert plan.vllm_version == VLLM_VERSION
    assert plan.spillway_version == OURS
    assert read_plan(plan.model_dump_json(), "p") == plan


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            json.dumps(OTHER_VLLM),
            [
                "plan p.json was made by",
                f"Spillway {OURS} for vLLM 0.32.0",
                f"this engine is Spillway {OURS} with vLLM {VLLM_VERSION}",
            ],
        ),
        (
            json.dumps(OTHER_SPILLWAY),
            [
                "plan p.json was made by",
                f"Spillway 0.0.9 for vLLM {VLLM_VERSION}",
                f"this engine is Spillway {OURS} with vLLM {VLLM_VERSION}",
            ],
        ),
        ('{"vllm_version": "0.33.0",', ["plan p.json is not valid JSON", "EOF"]),
        (json.dumps(plan_data(kv_groups=None)), ["plan p.json is missing kv_groups"]),
        (json.dumps(plan_data(spillway_version=None)), ["plan p.json is missing spillway_version"]),
        (
            json.dumps({**plan_data(), "kv_groups": [{"kind": "weird"}]}),
            ["plan p.json: kv_groups[0].kind: Input should be 'full_attention'", "more)"],
        ),
    ],
)
def test_reader_refusals_are_one_line(text, words):
    with pytest.raises(PlanReadError) as e:
        read_plan(text, "p.json")
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (None, "engine options"),
        ("nope", "is not valid JSON"),
        ({"revision": "x"}, "give model or weights_path"),
        ({"model": "m", "extra_args": "--seed 1"}, "extra_args must be a list of strings"),
        ({"model": "m", "gpu_memory_utilization": 1.5}, "must be in (0, 1]"),
        ({"model": "m", "gpu_memory_utilization": True}, "must be a number"),
        ({"model": 3}, "model must be a string"),
        ({"model": "m", "offload_enabled": "yes"}, "offload_enabled must be true or false"),
        ({"model": "m", "extra_args": ["--block-size", "32"]}, "--block-size is set by"),
        ({"model": "m", "dtype": "float16"}, "disagrees with the plan"),
    ],
)
def test_bad_engine_options_exit_2(tmp_path, capsys, options, match):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), options)
    code, _, err = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 2
    assert match in one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([], "usage: spillway-engine"),
        (["bogus"], "unknown command 'bogus'"),
        (["serve"], "the following arguments are required: --plan"),
        (["serve", "--plan", "p.json", "--port", "70000"], "not between 1 and 65535"),
        (["serve", "--plan", "p.json", "--tensor-parallel-size", "2"], "unrecognized arguments"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, match):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert match in err and "Traceback" not in err


def test_help_exits_0(capsys):
    assert main(["serve", "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out


class Exec:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []

    def __call__(self, path: str, argv: list[str], env: dict[str, str]) -> None:
        self.calls.append((path, argv, env))


def ready_to_exec(tmp_path, monkeypatch) -> tuple[Plan, Path, Exec]:
    """An upstream Llama plan on disk, vLLM 0.33.0 and the plugin "installed", and
    execve recorded instead of run (another plugin already allow-listed)."""
    plan = plan_for(LLAMA, offloader="upstream")
    path = write(tmp_path, plan, {"model": "m"})
    fake = Exec()
    monkeypatch.setattr(serve.os, "execve", fake)
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(serve, "plugin_registered", lambda: True)
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    return plan, path, fake


def test_serve_execs_vllm_with_the_plugin_env(tmp_path, capsys, monkeypatch):
    plan, path, fake = ready_to_exec(tmp_path, monkeypatch)
    code, out, err = run(capsys, "serve", "--plan", str(path))
    assert code == 0 and out == ""
    [(exe, argv, env)] = fake.calls
    expected, _ = build_command(plan, EngineOptions(model="m"))
    assert exe == argv[0]
    assert argv[argv.index("serve") :] == expected[1:]
    assert exe.endswith("/vllm") or argv[1:3] == ["-m", "vllm.entrypoints.cli.main"]
    assert env["SPILLWAY_PLAN"] == str(path.resolve())
    assert env["SPILLWAY_ENGINE_OPTIONS"] == str((tmp_path / "engine.json").resolve())
    assert env["VLLM_PLUGINS"] == "other,spillway"
    assert "exec vllm serve m" in err


@pytest.mark.parametrize(
    ("found", "match"),
    [("0.32.0", "needs vLLM 0.33.0, but vLLM 0.32.0 is installed"), (None, "not installed")],
)
def test_serve_refuses_another_vllm(tmp_path, capsys, monkeypatch, found, match):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: found)
    monkeypatch.setattr(serve.os, "execve", Exec())
    code, _, err = run(capsys, "serve", "--plan", str(path))
    assert code == 2 and match in one_error_line(err)


def test_serve_refuses_without_the_plugin(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(serve, "plugin_registered", lambda: False)
    fake = Exec()
    monkeypatch.setattr(serve.os, "execve", fake)
    code, _, err = run(capsys, "serve", "--plan", str(path))
    assert code == 2 and "plugin is not registered" in one_error_line(err)
    assert fake.calls == []


def test_simulate_delegates_to_the_simulator(capsys, tmp_path):
    code, _, err = run(capsys, "simulate", "--plan", str(tmp_path / "missing.json"))
    assert code == 2
    assert err.startswith("spillway-engine simulate: error:")


# ------------------------------------------------------------- plan check (pure)


def observed_from(plan: Plan, **changes: Any) -> ObservedGeometry:
    """What vLLM would report if it built exactly the plan (upstream connector)."""
    up = plan.upstream
    assert up is not None
    fields = {
        "tensor_parallel_size": plan.parallelism.tensor_parallel_size,
        "pipeline_parallel_size": plan.parallelism.pipeline_parallel_size,
        "max_model_len": plan.max_model_len,
        "groups": tuple(
            ObservedGroup(
                g.kind, g.num_layers, g.tokens_per_block, g.page_bytes, g.sliding_window
            )
            for g in plan.kv_groups
        ),
        "tokens_per_hash": plan.tokens_per_hash,
        "worker_bytes_per_block": plan.worker_bytes_per_block,
        "kv_connector": "OffloadingConnector",
        "cpu_bytes_to_use": plan.cpu_memory_bytes,
        "blocks_per_chunk": up.blocks_per_chunk,
        "row_bytes": up.row_bytes,
        "num_chunks": up.num_chunks,
    }
    fields.update(changes)
    return ObservedGeometry(**fields)


@pytest.mark.parametrize("model", [GEMMA, LLAMA, QWEN_NEXT])
@pytest.mark.parametrize("offloader", ["upstream", "spillway"])
def test_compare_accepts_the_planned_geometry(model, offloader):
    plan = plan_for(model, offloader=offloader)
    assert compare(plan, observed_from(plan)) == []


def test_compare_names_every_differing_field():
    plan = plan_for(GEMMA, offloader="upstream")
    groups = list(observed_from(plan).groups)
    groups[2] = ObservedGroup("sliding_window", 4, 16, 32768, 512)
    observed = observed_from(
        plan,
        groups=tuple(groups),
        tokens_per_hash=32,
        blocks_per_chunk=8,
        max_model_len=4096,
    )
    found = {m.field: (m.plan, m.vllm) for m in compare(plan, observed)}
    assert found == {
        "max_model_len": (8192, 4096),
        "kv_groups[2].page_bytes": (16384, 32768),
        "kv_groups[2].bytes_per_block": (65536, 131072),
        "tokens_per_hash": (16, 32),
        "blocks_per_chunk": (16, 8),
    }


def test_compare_group_count_and_kinds():
    plan = plan_for(QWEN_NEXT, offloader="upstream")
    observed = observed_from(plan)
    fewer = observed_from(plan, groups=observed.groups[1:])
    fields = [m.field for m in compare(plan, fewer)]
    assert fields[0] == "kv_groups (count)" and "kv_groups[0].kind" not in fields
    assert "kv_groups[2].kind" in fields  # the attention group sits one place earlier


def test_compare_offload_variants():
    plan = plan_for(LLAMA, offloader="upstream")
    off = observed_from(plan, kv_connector=None, blocks_per_chunk=None, row_bytes=None,
                        num_chunks=None, cpu_bytes_to_use=None)
    assert compare(plan, off) == []  # offloading off: nothing chunked to compare
    refused = observed_from(plan, blocks_per_chunk=None, offload_error="'blocks_per_chunk' must")
    [m] = compare(plan, refused)
    assert m.field == "offloading config" and "refused" in m.vllm
    pool = observed_from(plan, cpu_bytes_to_use=GIB)
    assert [m.field for m in compare(plan, pool)] == ["cpu_bytes_to_use"]
    other = observed_from(plan, kv_connector="LMCacheConnectorV1")
    assert [(m.field, m.vllm) for m in compare(plan, other)] == [
        ("kv_connector", "LMCacheConnectorV1")
    ]
    spill = without_upstream(plan_for(GEMMA), "vLLM says no")
    got = compare(spill, observed_from(plan_for(GEMMA)))
    assert [m.field for m in got] == ["offloader"] and "vLLM says no" in got[0].plan


def test_effective_plan_for_an_overridden_connector():
    plan = plan_for(GEMMA)
    assert plan.offloader == "spillway" and plan.upstream is not None
    eff = effective_plan(plan, "OffloadingConnector")
    assert eff.offloader == "upstream"
    assert (
        eff.blocks_per_chunk,
        eff.num_chunks,
        eff.row_bytes,
        eff.capacity_tokens,
        eff.kv_connector_extra_config,
    ) == (
        plan.upstream.blocks_per_chunk,
        plan.upstream.num_chunks,
        plan.upstream.row_bytes,
        plan.upstream.capacity_tokens,
        plan.upstream.kv_connector_extra_config,
    )
    assert effective_plan(plan, "SpillwayOffloadingConnector") == plan
    assert plan.num_chunks != eff.num_chunks  # the input is left alone
    assert plan.offloader == "spillway"
    # without upstream figures there is nothing else to run: the plan stands
    refused = without_upstream(plan, "vLLM says no")
    assert effective_plan(refused, "OffloadingConnector") == refused


def test_mismatch_table_is_side_by_side():
    table = format_table(
        [Mismatch("kv_groups[0].page_bytes", 16384, 32768), Mismatch("num_chunks", 10, None)]
    )
    lines = table.splitlines()
    assert lines[0].split(" | ") == ["field                  ", "plan ", "vLLM"]
    assert set(lines[1]) <= {"-", "+"}
    assert lines[2].split("|")[1].strip() == "16384" and lines[2].endswith("32768")
    assert lines[3].endswith("-")
    err = PlanMismatch([Mismatch("tokens_per_hash", 16, 32)])
    assert "refusing to serve" in str(err) and "tokens_per_hash" in str(err)


# ------------------------------------------------------------------ plugin metrics


def test_plugin_reads_the_plan_file_with_the_planner_reader(tmp_path):
    plan = plan_for(GEMMA)
    path = write(tmp_path, plan)
    assert plugin.load_plan_file(str(path)) == plan


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read the plan"),
        ("{not json", "is not valid JSON"),
        (json.dumps(OTHER_VLLM), "for vLLM 0.32.0; this engine is Spillway"),
    ],
)
def test_plugin_refuses_a_plan_it_cannot_use(tmp_path, content, match):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(plugin.PluginError) as e:
        plugin.load_plan_file(str(path))
    assert str(e.value).startswith(f"SPILLWAY_PLAN={path}: ")
    assert match in str(e.value) and "\n" not in str(e.value)


def test_plan_metrics_published(monkeypatch):
    monkeypatch.setitem(plugin._state, "metrics", {})
    registry = CollectorRegistry()
    plan = effective_plan(plan_for(GEMMA), "OffloadingConnector")
    for _ in range(2):  # vLLM may build its stat logger more than once
        plugin.publish_plan_metrics(plan, "gemma", [0, 1], registry)
    value = registry.get_sample_value
    for engine in ("0", "1"):
        labels = {"model_name": "gemma", "engine": engine}
        assert value("spillway_host_pool_capacity_chunks", labels) == plan.num_chunks
        assert value("spillway_host_pool_capacity_tokens", labels) == plan.capacity_tokens
        assert value("spillway_host_pool_used_chunks", labels) == 0
        assert value("spillway_host_pool_evictions_total", labels) == 0
    text = generate_latest(registry).decode()
    info = [line for line in text.splitlines() if line.startswith("spillway_plan_info{")]
    assert len(info) == 2
    assert 'offloader="upstream"' in info[0]
    assert f'num_chunks="{plan.num_chunks}"' in info[0]
    assert 'group_kinds="' + ",".join(["sliding_window"] * 6 + ["full_attention"]) in info[0]


def test_dry_run_never_imports_vllm(tmp_path):
    """The launcher's planning half stays light: no vLLM or torch import for --dry-run."""
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    code = (
        "import sys\n"
        "from spillway_engine.cli import main\n"
        f"assert main(['serve', '--plan', {str(path)!r}, '--dry-run']) == 0\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("vllm serve m ")


# ----------------------------------------------------------- --emulate-gpu


def test_emulate_gpu_adds_only_the_emulators_worker_and_env(tmp_path, capsys):
    from spillway_engine import emulator

    plan = plan_for(LLAMA, offloader="spillway")
    path = write(tmp_path, plan, ENGINE_JSON)
    argv = ["serve", "--plan", str(path), "--port", "9000", "--dry-run"]
    code, out, err = run(capsys, *argv, "--emulate-gpu", "--emulate-speed", "0.5")
    assert code == 0
    planned, _ = build_command(
        plan, serve.load_engine_options(tmp_path / "engine.json"), port=9000
    )
    assert shlex.split(out) == [*planned, "--worker-cls", emulator.WORKER_QUALNAME]
    kv = emulated.default_emulated_kv_bytes(plan)
    [note] = err.splitlines()  # the env, for the record
    assert note.startswith("spillway-engine: note: emulated GPU: ")
    assert f"SPILLWAY_EMULATE_GPU=1 SPILLWAY_EMULATE_KV_BYTES={kv}" in note
    assert "SPILLWAY_EMULATE_SPEED=0.5" in note and "MODEL_PARAMS" not in note


def test_emulate_gpu_refuses_vllms_own_offloader_in_one_line(tmp_path, capsys):
    """vLLM 0.33.0's CPU offloading worker runs only on CUDA-alike and XPU GPUs: an
    upstream plan with offloading on is refused before vLLM starts; off, it runs."""
    plan = plan_for(LLAMA, offloader="upstream")
    path = write(tmp_path, plan, ENGINE_JSON)
    argv = ["serve", "--plan", str(path), "--dry-run", "--emulate-gpu"]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("spillway-engine: error: the emulated GPU cannot run "
                           "LlamaForCausalLM as planned: vLLM's own offloader")
    assert "plan with offloader spillway, or turn offloading off" in line
    write(tmp_path, plan, {**ENGINE_JSON, "offload_enabled": False})
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "--worker-cls" in out


def test_emulated_kv_budget_defaults_from_the_plan():
    from spillway_engine import emulator

    small = plan_for(LLAMA, max_model_len=1024)
    assert emulated.default_emulated_kv_bytes(small) == emulator.DEFAULT_KV_BYTES
    big = plan_for(LLAMA, max_model_len=131072)
    per_token = sum(g.bytes_per_block / g.tokens_per_block for g in big.kv_groups)
    assert emulated.default_emulated_kv_bytes(big) == int(2 * 131072 * per_token)
    args, env = emulated.emulated_launch(big, kv_bytes=123, speed=0, model_params=8e9)
    assert args == emulator.emulator_args()
    assert env == {
        emulator.ENV_EMULATE: "1",
        emulator.ENV_KV_BYTES: "123",
        emulator.ENV_SPEED: "0.0",
        emulator.ENV_MODEL_PARAMS: "8000000000.0",
    }


def test_emulated_serve_execs_with_the_emulator_env(tmp_path, capsys, monkeypatch):
    _, path, fake = ready_to_exec(tmp_path, monkeypatch)
    # Spillway's offloader: vLLM's own cannot run on the emulated GPU (refused above).
    path = write(tmp_path, plan_for(LLAMA, offloader="spillway"), {"model": "m"})
    argv = ["serve", "--plan", str(path), "--emulate-gpu", "--emulate-kv-bytes", "4e6"]
    code, _, _ = run(capsys, *argv, "--emulate-model-params", "8e9")
    assert code == 0
    [(_, argv_, env)] = fake.calls
    assert argv_[-2:] == ["--worker-cls", "spillway_engine.emulator.worker.EmulatedGpuWorker"]
    assert env["SPILLWAY_PLAN"] == str(path.resolve())
    assert env["SPILLWAY_EMULATE_GPU"] == "1"
    assert env["SPILLWAY_EMULATE_KV_BYTES"] == "4000000"
    assert env["SPILLWAY_EMULATE_SPEED"] == "1.0"  # real time unless asked otherwise
    assert env["SPILLWAY_EMULATE_MODEL_PARAMS"] == "8000000000.0"
    assert env["VLLM_PLUGINS"] == "other,spillway,spillway_emulator"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--emulate-speed", "0"], "need --emulate-gpu"),
        (["--emulate-gpu", "--emulate-speed", "-1"], "--emulate-speed"),
        (["--emulate-gpu", "--emulate-kv-bytes", "1.5"], "whole number"),
        (["--emulate-gpu", "--emulate-model-params", "0"], "> 0"),
    ],
)
def test_bad_emulate_options_exit_2(tmp_path, capsys, extra, match):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    code, out, err = run(capsys, "serve", "--plan", str(path), "--dry-run", *extra)
    assert code == 2 and out == "" and match in one_error_line(err)


# ------------------------------------------------------------------- KV events
# (where and under which topic they publish: test_kv_events_launch.py)


def test_a_hash_seed_is_noted_for_the_router(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, plan_for(LLAMA, offloader="upstream"), {"model": "m"})
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    code, _, err = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 0 and "spillway-router --hash-seed 42" in err
    monkeypatch.delenv("PYTHONHASHSEED")
    code, _, err = run(capsys, "serve", "--plan", str(path), "--dry-run")
    assert code == 0 and "--hash-seed" not in err


# ------------------------------------------------------- speculative decoding


def test_command_passes_the_plans_speculative_config():
    """The drafter's layers are in the plan's KV groups, so vLLM gets the same drafter."""
    from tests.unit.planner_fixtures import load_frontier

    plain = plan_for(LLAMA)
    assert plain.speculative_config() is None
    assert "--speculative-config" not in build_command(plain, OPTIONS)[0]

    mtp = make_plan(
        load_frontier("qwen3.5-35b-a3b"),
        PlanRequest(cpu_memory_bytes=8 << 30, max_model_len=4096,
                    speculative_method="mtp", num_speculative_tokens=2),
    )
    cmd, _ = build_command(mtp, OPTIONS)
    assert json.loads(flag(cmd, "--speculative-config")) == {
        "method": "mtp", "num_speculative_tokens": 2
    }

    drafted = make_plan(
        load_frontier("qwen3-8b"),
        PlanRequest(cpu_memory_bytes=8 << 30, max_model_len=8192, speculative_method="draft_model",
                    num_speculative_tokens=4, speculative_model="Qwen/Qwen3-0.6B"),
        load_frontier("qwen3-0.6b"),
    )
    cmd, _ = build_command(drafted, OPTIONS)
    assert json.loads(flag(cmd, "--speculative-config")) == {
        "method": "draft_model", "num_speculative_tokens": 4, "model": "Qwen/Qwen3-0.6B"
    }
    assert drafted.draft_layer_indices == list(range(36, 64))
