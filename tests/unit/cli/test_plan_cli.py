"""make_plan and the `spillway plan` command: JSON contract, table, refusals."""

import json
import subprocess
import sys

import pytest

from spillway_cli import main as cli
from spillway_engine import __version__
from spillway_engine import cli as engine_cli
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan, read_plan
from tests.unit.planner_fixtures import MODELS, load_model

GEMMA = str(MODELS / "gemma-3-27b-it.json")


def run(capsys, *args):
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, _ = run(capsys, "--model-config", GEMMA, "--cpu-memory", "64Gi", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    assert plan["vllm_version"] == "0.33.0"
    assert plan["spillway_version"] == __version__
    assert plan["gpu"]["name"] == "h100"
    assert plan["model"]["architecture"] == "Gemma3ForConditionalGeneration"
    assert plan["offloader"] == "spillway"
    group = plan["kv_groups"][0]
    assert set(group) >= {"kind", "num_layers", "tokens_per_block", "page_bytes", "sliding_window"}
    assert [g["kind"] for g in plan["kv_groups"]] == ["sliding_window"] * 6 + ["full_attention"]
    for key in (
        "tokens_per_hash",
        "worker_bytes_per_block",
        "blocks_per_chunk",
        "row_bytes",
        "num_chunks",
        "capacity_tokens",
    ):
        assert isinstance(plan[key], int) and plan[key] > 0, key
    assert set(plan["pod"]) >= {"shm_bytes", "memory_request_bytes", "memory_limit_bytes"}
    assert plan["spillway"]["chunk_tokens"] == 256
    assert plan["upstream"]["row_bytes"] == 20_971_520
    assert plan["kv_connector_extra_config"]["cpu_bytes_to_use"] == 64 * 2**30
    assert (
        plan["kv_transfer_config"]["kv_connector_extra_config"] == plan["kv_connector_extra_config"]
    )
    # the pool lives in /dev/shm and counts against the limit
    assert plan["pod"]["memory_limit_bytes"] > plan["pod"]["shm_bytes"] > plan["row_bytes"]
    # what the CLI prints is what the pod's reader takes, unchanged
    assert read_plan(out, "stdout").model_dump(mode="json") == plan


def test_upstream_offloader_figures(capsys):
    code, out, _ = run(
        capsys,
        "--model-config",
        GEMMA,
        "--cpu-memory",
        "100Gi",
        "--offloader",
        "upstream",
        "--format",
        "json",
    )
    plan = json.loads(out)
    assert code == 0
    assert (plan["row_bytes"], plan["num_chunks"]) == (20_971_520, 5120)
    assert plan["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 100 * 2**30,
        "blocks_per_chunk": 16,
    }
    assert plan["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"


def test_table_is_readable(capsys):
    code, out, _ = run(capsys, "--model-config", GEMMA, "--cpu-memory", "64Gi")
    assert code == 0
    for text in (
        "KV-cache groups",
        "sliding_window",
        "full_attention",
        "Spillway offloader",
        "vLLM offloader",
        "/dev/shm",
        "capacity",
    ):
        assert text in out


def test_memory_limit_picks_pool(capsys):
    code, out, _ = run(
        capsys, "--model-config", GEMMA, "--memory-limit", "96Gi", "--format", "json"
    )
    plan = json.loads(out)
    assert code == 0
    assert plan["pod"]["memory_limit_bytes"] <= 96 * 2**30
    assert plan["cpu_memory_bytes"] > 60 * 2**30


def test_pool_too_big_for_limit(capsys):
    code, _, err = run(
        capsys, "--model-config", GEMMA, "--cpu-memory", "200Gi", "--memory-limit", "64Gi"
    )
    assert code == 2
    assert "memory limit" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--cpu-memory", "-5Gi"], "cpu-memory"),
        (["--cpu-memory", "0"], "more than 0"),
        (["--cpu-memory", "lots"], "byte quantity"),
        (["--cpu-memory", "64Gi", "--tensor-parallel-size", "0"], "at least 1"),
        (["--cpu-memory", "64Gi", "--blocks-per-chunk", "0"], "greater than 0"),
        (["--cpu-memory", "1Ki"], "smaller than one"),
        (["--cpu-memory", "64Gi", "--gpu", "mi300x"], "unknown GPU 'mi300x'; known GPUs"),
        (["--cpu-memory", "64Gi", "--max-model-len", "999999999"], "context length"),
        ([], "--cpu-memory"),
    ],
)
def test_refusals_exit_2_with_one_line(capsys, args, match):
    code, out, err = run(capsys, "--model-config", GEMMA, *args)
    assert code == 2
    assert match in err
    assert err.count("\n") == 1 and "Traceback" not in err
    code, out, _ = run(capsys, "--model-config", GEMMA, *args, "--format", "json")
    assert code == 2
    assert match in json.loads(out)["error"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json at all", "not valid JSON"),
        ('{"architectures": ["LlamaForCausalLM"], "num_hidden', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"architectures": ["WeirdForCausalLM"]}', "not supported"),
        ('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 0}', "num_hidden_layers"),
        (
            '{"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4, '
            '"num_attention_heads": 2}',
            "linear_num_key_heads",
        ),
    ],
)
def test_bad_config_files(tmp_path, capsys, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run(capsys, "--model-config", str(tmp_path), "--cpu-memory", "64Gi")
    assert code == 2
    assert match in err and "Traceback" not in err


def test_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "--model-config", str(tmp_path / "nope.json"), "--cpu-memory", "1Gi")
    assert code == 2 and "does not exist" in err


def test_hub_offline_is_a_clear_error(capsys, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, _, err = run(capsys, "--model", "some-org/some-model", "--cpu-memory", "1Gi")
    assert code == 2
    assert "unreachable" in err


def test_hub_download_uses_cache_and_token(monkeypatch, tmp_path):
    from spillway_engine.planner import model_config

    (tmp_path / "config.json").write_text(json.dumps(load_model("llama-3.2-1b")))
    calls = []

    def fake_download(repo, filename, **kw):
        calls.append((repo, filename, kw))
        return str(tmp_path / "config.json")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    config = model_config.load_hub("meta-llama/Llama-3.2-1B", token="t0k")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert calls[0][:2] == ("meta-llama/Llama-3.2-1B", "config.json")
    assert calls[0][2]["token"] == "t0k"


def test_make_plan_refuses_with_reason():
    with pytest.raises(PlanRefused) as info:
        make_plan({"architectures": ["MambaForCausalLM"]}, PlanRequest(cpu_memory_bytes=2**30))
    assert "MambaForCausalLM" in info.value.reason


def test_spillway_plan_when_upstream_refuses():
    # no prefix caching: vLLM's offloader asserts; Spillway refuses too, with its reason
    with pytest.raises(PlanRefused, match="prefix caching"):
        make_plan(
            load_model("qwen3-next-80b-a3b-instruct"),
            PlanRequest(cpu_memory_bytes=2**36, enable_prefix_caching=False, max_model_len=8192),
        )


def test_plan_request_validation():
    with pytest.raises(ValueError):
        PlanRequest(tensor_parallel_size=0)
    with pytest.raises(ValueError):
        PlanRequest(offloader="lmcache")


def test_engine_cli_without_a_command(capsys):
    # the launcher itself is tested in test_engine_serve.py
    assert engine_cli.main([]) == 2
    assert "usage: spillway-engine" in capsys.readouterr().err


def test_no_subcommand(capsys):
    assert cli.main([]) == 2


def test_planner_never_imports_vllm():
    code = (
        "import sys, json\n"
        "from spillway_cli.main import main\n"
        f"main(['plan', '--model-config', {GEMMA!r}, '--cpu-memory', '1Gi', '--format', 'json'])\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_plan_with_a_draft_model_from_its_config(capsys):
    """draft_model / eagle3: the drafter's config.json from --draft-config; its layers
    join the plan's groups and the plan records what the engine passes to vLLM."""
    from tests.unit.planner_fixtures import FRONTIER

    args = ["--model-config", str(FRONTIER / "llama-3.1-8b-instruct.json"), "--cpu-memory",
            "8Gi", "--max-model-len", "8192", "--format", "json", "-tp", "2"]
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 5,
                       "model": "meta-llama/Llama-3.2-1B"})
    code, out, _ = run(capsys, *args, "--speculative-config", spec,
                       "--draft-config", str(MODELS / "llama-3.2-1b.json"))
    assert code == 0
    plan = json.loads(out)
    assert plan["speculative_model"] == "meta-llama/Llama-3.2-1B"
    assert plan["draft_layer_indices"] == list(range(32, 48))
    [group] = plan["kv_groups"]
    assert sorted(set(group["layer_page_bytes"])) == [16384, 32768]  # the 1B's and the 8B's
    # a method the planner does not model is refused by the argument parser, by name
    code, out, _ = run(capsys, *args, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3}')
    assert code == 2 and "'ngram' is not modelled" in json.loads(out)["error"]
    # --draft-config without a separate drafter is a mistake, said so
    code, out, _ = run(capsys, *args, "--draft-config", str(MODELS / "llama-3.2-1b.json"))
    assert code == 2 and "--draft-config is for" in json.loads(out)["error"]


def test_data_parallel_over_nodes_table(capsys):
    """`spillway plan --nodes 2 -dp 16`: whole engines a node, each node's figures."""
    deepseek = str(MODELS / "deepseek-v3.json")
    code, out, _ = run(capsys, "--model-config", deepseek, "-tp", "1", "-dp", "16", "--nodes",
                       "2", "--cpu-memory", "64Gi", "--gpu", "h200")
    assert code == 0
    assert "DP 16, 2 nodes of 8 DP ranks (node r holds DP ranks 8r..8r+7" in out
    assert "8 engine(s) per pod" in out and "Each node  /dev/shm" in out
    code, _, err = run(capsys, "--model-config", deepseek, "-dp", "3", "--nodes", "2",
                       "--cpu-memory", "64Gi")
    assert code != 0 and "data parallel size 3 does not split over 2 nodes" in err
