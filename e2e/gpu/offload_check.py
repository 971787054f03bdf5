"""GPU check of Spillway's host KV tier: vLLM 0.33.0 + ``SpillwayOffloadingConnector``.

Three tiny models (Llama-like, Gemma-3-like with sliding-window layers, Qwen3-Next-like
with Gated DeltaNet + full-attention layers) run with dummy weights, each twice, in a
fresh subprocess per run (vLLM does not reliably hand back GPU memory in one process):

* ``baseline``: no KV connector, a GPU KV pool large enough for the whole working set,
  so every repeated prefix is a GPU prefix-cache hit;
* ``offload``: the Spillway connector with a GPU KV pool of ~2.5 requests, so the
  working set (``--prefixes`` distinct prefixes) is evicted from the GPU and the repeats
  are served from the host tier.

Each run sends three phases of single-request greedy generations (token-id prompts,
``skip_tokenizer_init``): ``store`` (prefix_i + suffix A), ``load`` (prefix_i +
suffix B: the prefix is a cache hit) and ``repeat`` (prefix_i + suffix A again). The
prefixes are whole multiples of the chunk span and the suffixes shorter than a block,
so a run that restores every prefix computes exactly the same token shapes as the
baseline and its greedy token ids must be *bit-identical*.

Checks, per model: (a) identical greedy outputs wherever both runs cached the same
number of prompt tokens (``RequestOutput.num_cached_tokens``), with at least one such
request in the host-served phases; (b) host hits > 0 (``vllm:external_prefix_cache_hits``
in the offload run's load + repeat phases); (c) store/load GB/s from the connector's
``vllm:kv_offload_{store,load}_{bytes,time}`` counters, or, if it exports none, a wall-
clock lower bound (informational, never fails the check).

Usage: ``bash e2e/gpu/run.sh [--dry-run] [--models llama,gemma3,qwen3next] ...``;
see e2e/gpu/README.md. Only the child (``--child``) imports vLLM; ``--preflight`` only
looks for it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _load_pins() -> Any:
    """spillway_engine/vllm_pins.py, loaded by path: this check runs (and reports) before
    it knows whether spillway_engine is importable, and the file needs nothing else."""
    path = REPO / "engine" / "spillway_engine" / "vllm_pins.py"
    spec = importlib.util.spec_from_file_location("_spillway_vllm_pins", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PINS = _load_pins()
REQUIRED_VLLM: str = _PINS.VLLM_VERSION
CONNECTOR: str = _PINS.SPILLWAY_CONNECTOR
CONNECTOR_MODULE: str = _PINS.SPILLWAY_CONNECTOR_MODULE
PHASES = ("store", "load", "repeat")
HOST_PHASES = ("load", "repeat")
RESULT_FILE = "gpu-offload-check.json"
LOG_FILE = "gpu-offload-check.log"

# ---------------------------------------------------------------------------------------
# Models: tiny configs written locally (no hub), fields checked against vLLM 0.33.0's
# llama.py / gemma3.py / qwen3_next.py (+ qwen_gdn_linear_attn.py) and transformers'
# LlamaConfig / Gemma3TextConfig / Qwen3NextConfig.
# ---------------------------------------------------------------------------------------

VOCAB = 8192


def _llama() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def _gemma3() -> dict[str, Any]:
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "sliding_window": 128,
        "layer_types": layer_types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "dtype": "bfloat16",
    }


def _qwen3next() -> dict[str, Any]:
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        # vLLM's Qwen3NextForCausalLM needs at least one MoE layer (set_moe_parameters)
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: dict[str, Any]
    #: forced KV block size (tokens). Qwen3-Next: the attention page must hold a GDN
    #: state (~262 KiB here), so vLLM would raise 16 to >= 144 anyway; 256 is a multiple
    #: of the 64-token GDN checkpoint grid on Hopper and of the chunk span.
    block_size: int


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", _llama(), 16),
    "gemma3": ModelSpec("gemma3", _gemma3(), 16),
    "qwen3next": ModelSpec("qwen3next", _qwen3next(), 256),
}


def attention_bytes_per_token_upper(config: dict[str, Any]) -> int:
    """KV bytes per token if every layer kept an attention page per token (bf16).

    An upper bound for sizing: sliding-window layers free out-of-window blocks, and
    GDN layers hold one state page per block (padded to the attention page).
    """
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return layers * 2 * kv_heads * head_dim * 2


# ---------------------------------------------------------------------------------------
# Workload geometry
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    max_tokens: int
    chunk_tokens: int
    max_model_len: int

    @staticmethod
    def make(args: argparse.Namespace, spec: ModelSpec) -> Geometry:
        chunk = args.chunk_tokens or 256
        unit = math.lcm(chunk, spec.block_size)
        prefix_tokens = unit * max(1, math.ceil(args.prefix_tokens / unit))
        suffix = min(args.suffix_tokens, spec.block_size - 1)
        need = prefix_tokens + suffix + args.max_tokens
        max_model_len = spec.block_size * math.ceil((need + 16) / spec.block_size)
        return Geometry(args.prefixes, prefix_tokens, suffix, args.max_tokens, chunk, max_model_len)

    def kv_bytes(self, spec: ModelSpec, mode: str) -> int:
        per_token = attention_bytes_per_token_upper(spec.config)
        if mode == "offload":
            # ~2.5 max-length requests: max_model_len fits, the working set does not
            return int(2.5 * self.max_model_len * per_token)
        # the whole working set (all phases) with room to spare: nothing is evicted
        return int(1.5 * (3 * self.prefixes + 4) * self.max_model_len * per_token)


def make_prompts(geo: Geometry, seed: int = 1234) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, VOCAB - 16) for _ in range(n)]

    prefixes = [ids(geo.prefix_tokens) for _ in range(geo.prefixes)]
    suffix_a = [ids(geo.suffix_tokens) for _ in range(geo.prefixes)]
    suffix_b = [ids(geo.suffix_tokens) for _ in range(geo.prefixes)]
    return {
        "store": [p + a for p, a in zip(prefixes, suffix_a, strict=True)],
        "load": [p + b for p, b in zip(prefixes, suffix_b, strict=True)],
        "repeat": [p + a for p, a in zip(prefixes, suffix_a, strict=True)],
    }


def kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(args.cpu_gib * (1 << 30))}
    if args.chunk_tokens:
        extra["spillway_chunk_tokens"] = args.chunk_tokens
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def engine_kwargs(
    spec: ModelSpec, mode: str, geo: Geometry, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "enforce_eager": True,
        "seed": 0,
        "enable_prefix_caching": True,
        "block_size": spec.block_size,
        "max_model_len": geo.max_model_len,
        "max_num_seqs": 8,
        "max_num_batched_tokens": max(2048, geo.max_model_len),
        "kv_cache_memory_bytes": geo.kv_bytes(spec, mode),
        # with kv_cache_memory_bytes this only gates the free-memory check at start-up;
        # small so that two runs can share the GPU (--jobs)
        "gpu_memory_utilization": 0.2,
        "generation_config": "vllm",
        "disable_log_stats": False,
        "tensor_parallel_size": 1,
    }
    if "linear_attention" in spec.config.get("layer_types", []):
        # Triton/FLA by default: FlashInfer's Hopper GDN prefill may need a JIT build
        # (nvcc, minutes) where its cubins are not installed. Same kernel in both runs.
        kwargs["gdn_prefill_backend"] = args.gdn_prefill_backend
    if mode == "offload":
        kwargs["kv_transfer_config"] = kv_transfer_config(args)
    return kwargs


def write_configs(workdir: Path, names: list[str]) -> dict[str, Path]:
    dirs = {}
    for name in names:
        d = workdir / "models" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(MODELS[name].config, indent=2) + "\n")
        dirs[name] = d
    return dirs


# ---------------------------------------------------------------------------------------
# Child: one vLLM engine, one model, one mode. Imports vLLM; writes a result JSON.
# ---------------------------------------------------------------------------------------


def _reinit_weights(model: Any) -> int:
    """Deterministic unit-scale weights (dummy weights are +-1e-3: near-uniform logits
    that ignore the context, so a corrupted KV cache would not change the output).

    Matrices get N(0, 1/fan_in), vectors (norm scales, biases, GDN A_log/dt_bias)
    U[0.5, 1.5); each seeded by the parameter's name, so both runs get the same model.
    """
    import zlib

    import torch

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point() or param.numel() == 0:
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(zlib.crc32(name.encode()))
            if param.dim() >= 2:
                values = torch.randn(
                    param.shape, generator=gen, device=param.device, dtype=torch.float32
                ) * (param.shape[-1] ** -0.5)
            else:
                values = 0.5 + torch.rand(
                    param.shape, generator=gen, device=param.device, dtype=torch.float32
                )
            param.copy_(values.to(param.dtype))
            count += 1
    return count


def _kv_info(worker: Any) -> dict[str, Any]:
    """The worker's final KV-cache layout (block size, groups), read after start-up."""
    cfg = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if cfg is None:
        return {"error": "worker.model_runner.kv_cache_config not found"}
    groups = []
    for group in cfg.kv_cache_groups:
        kv_spec = group.kv_cache_spec
        entry: dict[str, Any] = {"kind": type(kv_spec).__name__, "layers": len(group.layer_names)}
        for attr in ("block_size", "page_size_bytes", "sliding_window"):
            with contextlib.suppress(Exception):
                entry[attr] = getattr(kv_spec, attr)
        groups.append(entry)
    info: dict[str, Any] = {"num_blocks": cfg.num_blocks, "groups": groups}
    for attr in ("hash_block_size", "cache_hit_alignment_tokens"):
        with contextlib.suppress(Exception):
            info[attr] = getattr(cfg, attr)
    with contextlib.suppress(Exception):
        info["tensor_bytes"] = sum(int(t.size) for t in cfg.kv_cache_tensors)
    return info


def _snapshot(llm: Any) -> dict[str, float]:
    """vLLM's Prometheus metrics as {name{labels}: value}, engine/model labels dropped."""
    snap: dict[str, float] = {}
    for metric in llm.get_metrics():
        labels = {
            k: v for k, v in sorted(metric.labels.items()) if k not in ("model_name", "engine")
        }
        key = metric.name
        if labels:
            key += "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"
        if hasattr(metric, "value"):
            snap[key] = snap.get(key, 0.0) + float(metric.value)
        elif hasattr(metric, "count"):
            snap[key + ":count"] = snap.get(key + ":count", 0.0) + float(metric.count)
            snap[key + ":sum"] = snap.get(key + ":sum", 0.0) + float(metric.sum)
    return snap


def _spillway_metrics() -> dict[str, float]:
    """Spillway's own families (not ``vllm:``-prefixed, so get_metrics skips them)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("spillway"):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                out[sample.name + (f"{{{labels}}}" if labels else "")] = float(sample.value)
    return out


def fake_child_main(args: argparse.Namespace) -> int:
    """--fake: a child that writes synthetic results (tests the parent without a GPU)."""
    spec = MODELS[args.child]
    geo = Geometry.make(args, spec)
    if f"{args.child}/{args.mode}" in os.environ.get("SPILLWAY_FAKE_HANG", ""):
        time.sleep(3600)
    kv = {
        "groups": [
            {"kind": "FullAttentionSpec", "layers": 1, "block_size": 16, "page_size_bytes": 32768}
        ]
    }
    flip = f"{args.child}/{args.mode}" in os.environ.get("SPILLWAY_FAKE_DIFF", "")
    result = _synthetic_run(args.mode, geo, kv, flip=flip)
    result["model"] = spec.name
    if args.mode == "offload":
        print("INFO Spillway offloader: 256-token chunks; groups [0] cut [16] blocks per chunk")
    Path(args.result).write_text(json.dumps(result))
    return 0


def child_main(args: argparse.Namespace) -> int:
    spec = MODELS[args.child]
    geo = Geometry.make(args, spec)
    model_dir = Path(args.workdir) / "models" / spec.name
    result: dict[str, Any] = {
        "model": spec.name,
        "mode": args.mode,
        "geometry": asdict(geo),
        "ok": False,
    }
    result_path = Path(args.result)

    def save() -> None:
        result_path.write_text(json.dumps(result))

    t_start = time.monotonic()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm"] = vllm.__version__
        result["torch"] = torch.__version__
        kwargs = engine_kwargs(spec, args.mode, geo, model_dir, args)
        result["engine_kwargs"] = kwargs
        llm = LLM(**kwargs)
        result["startup_s"] = round(time.monotonic() - t_start, 1)
        result["reinit_params"] = llm.apply_model(_reinit_weights)[0]
        result["kv"] = llm.collective_rpc(_kv_info)[0]
        with contextlib.suppress(Exception):
            result["block_size_seen"] = llm.llm_engine.vllm_config.cache_config.block_size
        prompts = make_prompts(geo)
        params = SamplingParams(
            temperature=0.0, max_tokens=geo.max_tokens, ignore_eos=True, detokenize=False
        )
        before = _snapshot(llm)
        result["metrics_start"] = before
        phases: dict[str, Any] = {}
        for phase in PHASES:
            outputs, cached = [], []
            t0 = time.perf_counter()
            # one request at a time: every step holds one request, in both runs, so
            # the kernels see the same shapes and greedy outputs can be compared bitwise
            for ids in prompts[phase]:
                out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                outputs.append(list(out.outputs[0].token_ids))
                cached.append(int(out.num_cached_tokens or 0))
            wall = time.perf_counter() - t0
            after = _snapshot(llm)
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            phases[phase] = {
                "wall_s": round(wall, 4),
                "outputs": outputs,
                "cached_tokens": cached,
                "metrics_delta": {k: v for k, v in delta.items() if v},
            }
            before = after
            result["phases"] = phases
            save()
        result["metrics_end"] = before
        # only now: CUDA initialised in this process before LLM() would force 'spawn'
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        with contextlib.suppress(Exception):
            result["spillway_metrics"] = _spillway_metrics()
        result["ok"] = True
    except BaseException as exc:
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    result["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    print(f"child {spec.name}/{args.mode}: ok={result['ok']} in {result['total_s']} s", flush=True)
    # skip interpreter teardown: vLLM's atexit/GC paths can hang on a dead CUDA context
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


# ---------------------------------------------------------------------------------------
# Parent: preflight, run the children, compare, report.
# ---------------------------------------------------------------------------------------


def preflight() -> list[str]:
    """What this Python lacks for the GPU run (empty: ready). Imports no vLLM."""
    problems: list[str] = []
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    torch_desc = "no torch"
    if importlib.util.find_spec("torch") is None:
        problems.append(f"torch (CUDA build) is not importable by {here}")
    else:
        try:
            import torch

            torch_desc = f"torch {torch.__version__}"
            if not torch.cuda.is_available():
                problems.append(f"{torch_desc} sees no CUDA GPU")
        except Exception as exc:
            problems.append(f"import torch failed: {exc!r}")
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != REQUIRED_VLLM:
        what = "not installed" if found is None else f"{found} installed"
        problems.append(
            f"vllm=={REQUIRED_VLLM} ({what} for {here}, {torch_desc}; it pins torch==2.14.0 "
            "and ships ~660 MB of CUDA kernels: the nvidia-h200 image has no vLLM, no network, "
            "and the working tree that travels is capped at 64 MiB; see e2e/gpu/README.md)"
        )
    if importlib.util.find_spec("spillway_engine") is None:
        problems.append("spillway_engine is not importable (PYTHONPATH must hold <repo>/engine)")
    elif found == REQUIRED_VLLM:
        try:
            module = importlib.import_module(CONNECTOR_MODULE)
            if not hasattr(module, CONNECTOR):
                problems.append(f"{CONNECTOR_MODULE} has no {CONNECTOR}")
        except Exception as exc:
            problems.append(f"import {CONNECTOR_MODULE} failed: {exc!r}")
    return problems


@dataclass
class Task:
    model: str
    mode: str
    result: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    deadline: float = 0.0
    status: str = "pending"
    data: dict[str, Any] = field(default_factory=dict)


def _child_cmd(task: Task, args: argparse.Namespace) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        task.model,
        "--mode",
        task.mode,
        "--result",
        str(task.result),
        "--workdir",
        str(args.workdir),
    ]
    for opt in ("prefixes", "prefix_tokens", "suffix_tokens", "max_tokens", "chunk_tokens"):
        cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    cmd += ["--cpu-gib", str(args.cpu_gib), "--gdn-prefill-backend", args.gdn_prefill_backend]
    if args.fake:
        cmd.append("--fake")
    return cmd


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "engine"), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if args.inproc else "1",
            # callables sent to the workers (apply_model / collective_rpc) in mp mode
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
    )
    return env


def _kill(task: Task) -> None:
    if task.proc is not None and task.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(task.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            task.proc.wait(timeout=10)


def run_tasks(tasks: list[Task], args: argparse.Namespace, deadline: float) -> None:
    env = _child_env(args)
    pending = list(tasks)
    running: list[Task] = []
    try:
        while pending or running:
            while pending and len(running) < args.jobs and time.monotonic() < deadline - 30:
                task = pending.pop(0)
                task.started = time.monotonic()
                task.deadline = min(task.started + args.timeout_per_run, deadline)
                with task.log.open("wb") as log:
                    task.proc = subprocess.Popen(
                        _child_cmd(task, args),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=str(REPO),
                        start_new_session=True,
                    )
                task.status = "running"
                running.append(task)
                print(f"  start {task.model}/{task.mode} (pid {task.proc.pid})", flush=True)
            if not running:
                for task in pending:
                    task.status = "skipped (out of time budget)"
                pending.clear()
                break
            time.sleep(0.5)
            for task in list(running):
                assert task.proc is not None
                rc = task.proc.poll()
                took = time.monotonic() - task.started
                if rc is None and time.monotonic() < task.deadline:
                    continue
                if rc is None:
                    _kill(task)
                    task.status = f"timeout after {took:.0f} s"
                else:
                    task.status = "done" if rc == 0 else f"exit {rc}"
                running.remove(task)
                with contextlib.suppress(Exception):
                    task.data = json.loads(task.result.read_text())
                print(f"  end   {task.model}/{task.mode}: {task.status} ({took:.0f} s)", flush=True)
    finally:
        for task in running:
            _kill(task)
            task.status = "killed"


def _sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
        if all(got.get(k) == v for k, v in labels.items()):
            total += value
    return total


def _phase_metric(run: dict[str, Any], phases: tuple[str, ...], name: str, **labels: str) -> float:
    return sum(
        _sum(run.get("phases", {}).get(p, {}).get("metrics_delta", {}), name, **labels)
        for p in phases
    )


def _groups_desc(run: dict[str, Any]) -> str:
    groups = (run.get("kv") or {}).get("groups") or []
    if not groups:
        return "?"
    kinds: dict[str, int] = {}
    for g in groups:
        kind = g.get("kind", "?")
        short = "M" if "Mamba" in kind else "S" if "Sliding" in kind else "F"
        kinds[short] = kinds.get(short, 0) + 1
    return f"{len(groups)} (" + " ".join(f"{k}{n}" for k, n in sorted(kinds.items())) + ")"


def _chunk_desc(run: dict[str, Any], requested: int | None) -> str:
    end = run.get("metrics_end") or {}
    for key in end:
        if key.startswith("vllm:kv_offload_config_info{"):
            for kv in key.partition("{")[2].rstrip("}").split(","):
                k, _, v = kv.partition("=")
                if "chunk" in k and "token" in k and v:
                    return v
    if requested is None:
        return "?"
    return str(requested) if requested else "default"


def _bytes_per_token(run: dict[str, Any]) -> float:
    """GPU KV bytes per token of the attention groups (for the wall-clock estimate)."""
    total = 0.0
    for g in (run.get("kv") or {}).get("groups") or []:
        if "Mamba" in g.get("kind", "") or not g.get("block_size") or not g.get("page_size_bytes"):
            continue
        total += g["page_size_bytes"] * g.get("layers", 1) / g["block_size"]
    return total


def _bandwidth(off: dict[str, Any]) -> dict[str, Any]:
    end = off.get("metrics_end") or {}
    out: dict[str, Any] = {}
    for direction, legacy in (("store", "GPU_to_CPU"), ("load", "CPU_to_GPU")):
        nbytes = _sum(end, f"vllm:kv_offload_{direction}_bytes")
        secs = _sum(end, f"vllm:kv_offload_{direction}_time")
        source = "connector"
        if not nbytes:
            nbytes = _sum(end, "vllm:kv_offload_total_bytes", transfer_type=legacy)
            secs = _sum(end, "vllm:kv_offload_total_time", transfer_type=legacy)
        if not nbytes or not secs:
            # wall-clock lower bound: bytes the phase must have moved / the phase's time
            geo = off.get("geometry") or {}
            per_token = _bytes_per_token(off)
            if direction == "store":
                nbytes = geo.get("prefixes", 0) * geo.get("prefix_tokens", 0) * per_token
                secs = (off.get("phases") or {}).get("store", {}).get("wall_s", 0.0)
            else:
                hits = _phase_metric(off, HOST_PHASES, "vllm:external_prefix_cache_hits")
                nbytes = hits * per_token
                secs = sum(
                    (off.get("phases") or {}).get(p, {}).get("wall_s", 0.0) for p in HOST_PHASES
                )
            source = "wall (lower bound)"
        gbps = nbytes / secs / 1e9 if nbytes and secs else None
        out[direction] = {"bytes": nbytes, "seconds": secs, "gb_per_s": gbps, "source": source}
    return out


def compare(model: str, base: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Per-model verdict from the two child results."""
    summary: dict[str, Any] = {"model": model, "failures": [], "warnings": []}
    fails, warns = summary["failures"], summary["warnings"]
    for label, run in (("baseline", base), ("offload", off)):
        if not run.get("ok"):
            err = run.get("error") or "no result (see log)"
            fails.append(f"{label} run failed: {err}")
    summary["groups"] = _groups_desc(off if off.get("kv") else base)
    summary["chunk_tokens"] = _chunk_desc(off, (off.get("geometry") or {}).get("chunk_tokens"))
    if base.get("kv") and off.get("kv"):
        bs_b = [g.get("block_size") for g in base["kv"].get("groups", [])]
        bs_o = [g.get("block_size") for g in off["kv"].get("groups", [])]
        if bs_b != bs_o:
            warns.append(f"block sizes differ: baseline {bs_b}, offload {bs_o}")
    pairs = identical = strict = strict_mismatch = loose_mismatch = 0
    strict_host = shortfall = 0
    first_diff = None
    for phase in PHASES:
        pb = (base.get("phases") or {}).get(phase)
        po = (off.get("phases") or {}).get(phase)
        if not pb or not po:
            continue
        rows = zip(
            pb["outputs"], po["outputs"], pb["cached_tokens"], po["cached_tokens"], strict=False
        )
        for i, (tb, to, cb, co) in enumerate(rows):
            pairs += 1
            same = tb == to
            identical += same
            if co < cb:
                shortfall += 1
            if cb == co:
                strict += 1
                strict_host += phase in HOST_PHASES
                if not same:
                    strict_mismatch += 1
            elif not same:
                loose_mismatch += 1
            if not same and first_diff is None:
                first_diff = {
                    "phase": phase,
                    "index": i,
                    "baseline": tb,
                    "offload": to,
                    "cached_baseline": cb,
                    "cached_offload": co,
                }
    summary.update(
        pairs=pairs,
        identical=identical,
        strict_pairs=strict,
        strict_mismatches=strict_mismatch,
        strict_host_pairs=strict_host,
        nonstrict_mismatches=loose_mismatch,
        hit_shortfall=shortfall,
        first_difference=first_diff,
    )
    expected = 3 * (off.get("geometry") or {}).get("prefixes", 0)
    distinct = {t for p in (base.get("phases") or {}).values() for out in p["outputs"] for t in out}
    summary["baseline_distinct_tokens"] = len(distinct)
    if off.get("ok") and base.get("ok"):
        if pairs < expected:
            fails.append(f"only {pairs}/{expected} requests compared")
        if strict_mismatch:
            fails.append(
                f"(a) {strict_mismatch} greedy outputs differ although both runs cached the "
                "same prompt tokens"
            )
        if len(distinct) < 16:
            fails.append(
                f"(a) the baseline's outputs are degenerate ({len(distinct)} distinct tokens): "
                "comparing them would not catch a corrupted KV cache"
            )
        if not strict_host:
            fails.append(
                "(a) no request in the load/repeat phases cached as many prompt tokens as the "
                "GPU-only baseline: nothing to compare bitwise"
            )
        if loose_mismatch:
            warns.append(
                f"{loose_mismatch} outputs differ where the runs cached different token counts "
                "(different prefill shapes: bf16 rounding, not a bitwise check)"
            )
        if shortfall:
            warns.append(f"{shortfall} requests cached fewer prompt tokens than the baseline")
    host_hits = _phase_metric(off, HOST_PHASES, "vllm:external_prefix_cache_hits")
    host_src = _phase_metric(off, HOST_PHASES, "vllm:prompt_tokens_cached_by_source", source="host")
    gpu_hits_off = _phase_metric(off, HOST_PHASES, "vllm:prefix_cache_hits")
    gpu_hits_base = _phase_metric(base, HOST_PHASES, "vllm:prefix_cache_hits")
    store_host_hits = _phase_metric(off, ("store",), "vllm:external_prefix_cache_hits")
    summary.update(
        host_hit_tokens=int(host_hits),
        host_source_tokens=int(host_src),
        gpu_hit_tokens_offload=int(gpu_hits_off),
        gpu_hit_tokens_baseline=int(gpu_hits_base),
        store_phase_host_hits=int(store_host_hits),
    )
    if off.get("ok") and host_hits <= 0:
        why = (
            "the GPU kept the working set (no eviction?)"
            if gpu_hits_off >= gpu_hits_base > 0
            else "repeated prefixes were recomputed"
        )
        fails.append(f"(b) no host hits in the load/repeat phases: {why}")
    if off.get("ok"):
        summary["bandwidth"] = _bandwidth(off)
    summary["outputs_identical"] = (
        "n/a"
        if not pairs
        else "yes"
        if identical == pairs
        else f"no ({pairs - identical}/{pairs} differ)"
    )
    summary["status"] = "FAIL" if fails else "PASS"
    return summary


def _fmt_gbps(summary: dict[str, Any], direction: str) -> str:
    bw = (summary.get("bandwidth") or {}).get(direction) or {}
    if bw.get("gb_per_s") is None:
        return "n/a"
    mark = "" if bw.get("source") == "connector" else " (wall)"
    return f"{bw['gb_per_s']:.2f}{mark}"


def render_table(summaries: list[dict[str, Any]]) -> str:
    head = [
        "model",
        "groups",
        "chunk tokens",
        "host hits",
        "outputs identical",
        "store GB/s",
        "load GB/s",
        "result",
    ]
    rows = [head]
    for s in summaries:
        rows.append(
            [
                s["model"],
                s.get("groups", "?"),
                str(s.get("chunk_tokens", "?")),
                f"{s.get('host_hit_tokens', 0)} tok",
                s.get("outputs_identical", "?"),
                _fmt_gbps(s, "store"),
                _fmt_gbps(s, "load"),
                s.get("status", "?"),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _connector_log_facts(log: Path) -> dict[str, Any]:
    """Chunk span and offloaded groups from the connector's start-up line, if logged."""
    import re

    if not log.exists():
        return {}
    pattern = re.compile(r"Spillway offloader: (\d+)-token chunks; groups \[([\d, ]*)\]")
    match = pattern.search(log.read_text(errors="replace"))
    if not match:
        return {}
    groups = [int(g) for g in match.group(2).replace(" ", "").split(",") if g]
    return {"chunk_tokens": match.group(1), "offloaded_groups": groups}


def _out_dir() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) if out else None


def write_outputs(report: dict[str, Any], logs: list[Path]) -> None:
    out = _out_dir()
    targets = [Path(report["workdir"])] + ([out] if out else [])
    for target in targets:
        target.mkdir(parents=True, exist_ok=True)
        (target / RESULT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    if out and logs:
        with (out / LOG_FILE).open("w") as fh:
            for log in logs:
                if not log.exists():
                    continue
                lines = log.read_text(errors="replace").splitlines()
                fh.write(f"===== {log.name} ({len(lines)} lines, last 400) =====\n")
                fh.write("\n".join(lines[-400:]) + "\n")


def _env_report() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    for pkg in ("vllm", "torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[pkg] = importlib.metadata.version(pkg)
    return info


def parent_main(args: argparse.Namespace) -> int:
    names = args.models
    report: dict[str, Any] = {"status": "running", "workdir": str(args.workdir), **_env_report()}
    problems = [] if args.fake else preflight()
    if problems:
        print("gpu-offload-check: cannot run: " + "; ".join(problems), flush=True)
        report.update(status="missing", problems=problems)
        write_outputs(report, [])
        return 3
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    workdir = Path(args.workdir)
    write_configs(workdir, names)
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    tasks = [
        Task(
            name,
            mode,
            workdir / "runs" / f"{name}-{mode}.json",
            workdir / "runs" / f"{name}-{mode}.log",
        )
        for name in names
        for mode in ("baseline", "offload")
    ]
    for task in tasks:
        task.result.unlink(missing_ok=True)
    print(
        f"gpu-offload-check: {len(tasks)} runs, {args.jobs} at a time, "
        f"budget {args.budget_s} s, workdir {workdir}",
        flush=True,
    )

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    interrupted = None
    try:
        run_tasks(tasks, args, deadline)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "interrupted"
        for task in tasks:
            with contextlib.suppress(Exception):
                task.data = task.data or json.loads(task.result.read_text())
    by_key = {(t.model, t.mode): t for t in tasks}
    summaries = []
    for name in names:
        base, off = by_key[(name, "baseline")], by_key[(name, "offload")]
        for task in (base, off):
            if task.status != "done":
                task.data["ok"] = False
                task.data.setdefault("error", task.status)
        summary = compare(name, base.data, off.data)
        summary["run_status"] = {"baseline": base.status, "offload": off.status}
        seen = _connector_log_facts(off.log)
        if seen:
            summary.update(seen)
            summary["chunk_tokens"] = seen["chunk_tokens"]
            summary["groups"] += f", {len(seen['offloaded_groups'])} offloaded"
        summaries.append(summary)
    print()
    print(render_table(summaries))
    print()
    for s in summaries:
        for msg in s["failures"]:
            print(f"FAIL {s['model']}: {msg}")
        for msg in s["warnings"]:
            print(f"warn {s['model']}: {msg}")
    for task in tasks:
        if task.status != "done" and task.log.exists():
            tail = task.log.read_text(errors="replace").splitlines()[-25:]
            print(f"--- last lines of {task.log} ---")
            print("\n".join(tail))
    ok = all(s["status"] == "PASS" for s in summaries) and not interrupted
    report.update(
        status="pass" if ok else "fail",
        interrupted=interrupted,
        elapsed_s=round(time.monotonic() - t0, 1),
        args={k: str(v) for k, v in vars(args).items()},
        models={s["model"]: s for s in summaries},
        runs={f"{t.model}/{t.mode}": t.data for t in tasks},
    )
    write_outputs(report, [t.log for t in tasks])
    print(
        f"\ngpu-offload-check: {'PASS' if ok else 'FAIL'} in {report['elapsed_s']} s "
        f"(result: {workdir / RESULT_FILE})",
        flush=True,
    )
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------
# Dry run: configs + what a CPU can validate, and the report code on synthetic results.
# ---------------------------------------------------------------------------------------


def _synthetic_run(
    mode: str, geo: Geometry, kv: dict[str, Any], flip: bool = False
) -> dict[str, Any]:
    outputs = {
        p: [[(i * 31 + j) % VOCAB for j in range(geo.max_tokens)] for i in range(geo.prefixes)]
        for p in PHASES
    }
    if flip:
        outputs["load"][0] = [8] * geo.max_tokens
    cached = {"store": 0, "load": geo.prefix_tokens, "repeat": geo.prefix_tokens}
    phases = {}
    for p in PHASES:
        delta: dict[str, float] = {}
        if p in HOST_PHASES:
            hits = float(geo.prefixes * geo.prefix_tokens)
            if mode == "offload":
                delta["vllm:external_prefix_cache_hits"] = hits
                delta["vllm:prompt_tokens_cached_by_source{source=host}"] = hits
            else:
                delta["vllm:prefix_cache_hits"] = hits
        phases[p] = {
            "wall_s": 1.0,
            "outputs": outputs[p],
            "cached_tokens": [cached[p]] * geo.prefixes,
            "metrics_delta": delta,
        }
    end = {}
    if mode == "offload":
        end = {
            "vllm:kv_offload_store_bytes": 4.0e9,
            "vllm:kv_offload_store_time": 0.2,
            "vllm:kv_offload_load_bytes": 8.0e9,
            "vllm:kv_offload_load_time": 0.4,
        }
    return {
        "ok": True,
        "mode": mode,
        "geometry": asdict(geo),
        "kv": kv,
        "phases": phases,
        "metrics_end": end,
    }


def dry_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    workdir = Path(args.workdir)
    dirs = write_configs(workdir, args.models)
    report: dict[str, Any] = {
        "status": "dry-run",
        "workdir": str(workdir),
        **_env_report(),
        "models": {},
    }
    failures: list[str] = []
    harness = None
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        try:  # must come before any other vLLM import: it selects vLLM's CPU platform
            sys.path.insert(0, str(REPO))
            from tests.contract import vllm_harness as harness  # type: ignore[no-redef]
        except Exception as exc:
            print(
                f"note: tests/contract/vllm_harness unavailable ({exc!r}); "
                "vLLM planning not checked"
            )
            harness = None
    from transformers import AutoConfig

    for name in args.models:
        spec = MODELS[name]
        geo = Geometry.make(args, spec)
        entry: dict[str, Any] = {"dir": str(dirs[name]), "geometry": asdict(geo)}
        cfg = AutoConfig.from_pretrained(str(dirs[name]))
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        entry["transformers"] = {
            "class": type(cfg).__name__,
            "architectures": cfg.architectures,
            "layer_types": getattr(text, "layer_types", None),
        }
        for key, value in spec.config.items():
            if key in ("architectures", "dtype", "rope_parameters"):
                continue
            got = getattr(text, key, None)
            if got != value:
                failures.append(f"{name}: transformers parsed {key}={got!r}, wrote {value!r}")
        print(
            f"[{name}] transformers {type(cfg).__name__}: OK "
            f"(layers {text.num_hidden_layers}, layer_types {getattr(text, 'layer_types', '-')})"
        )
        entry["kv_bytes"] = {m: geo.kv_bytes(spec, m) for m in ("baseline", "offload")}
        if harness is not None:
            try:
                entry["vllm"] = _dry_vllm(harness, spec, geo, dirs[name], args)
                v = entry["vllm"]
                print(
                    f"[{name}] vLLM: {v['architecture']}, block {v['block_size']}, "
                    f"groups {v['groups_desc']}; pool blocks offload {v['num_blocks']['offload']}"
                    f" / baseline {v['num_blocks']['baseline']}; ~prompts cached on GPU: "
                    f"offload {v['prompts_fit']['offload']:.1f}, baseline "
                    f"{v['prompts_fit']['baseline']:.1f} (working set {geo.prefixes})"
                )
                c = v["connector"]
                if "chunk_tokens" in c:
                    print(
                        f"[{name}] Spillway geometry: {c['chunk_tokens']}-token chunks, groups "
                        f"{c['offloaded_groups']} cut {c['blocks_per_chunk']} blocks/chunk, "
                        f"{c['num_units']} units of {c['unit_bytes']} B"
                    )
                else:
                    print(f"[{name}] Spillway geometry: {c}")
                failures.extend(f"{name}: {msg}" for msg in v["problems"])
            except Exception as exc:
                import traceback

                traceback.print_exc()
                failures.append(f"{name}: vLLM rejected the config: {exc!r}")
        report["models"][name] = entry
    # the report path on synthetic results (no GPU): one passing, one failing model
    geo = Geometry.make(args, MODELS["llama"])
    kv = {
        "groups": [
            {
                "kind": "FullAttentionSpec",
                "layers": 4,
                "block_size": 16,
                "page_size_bytes": 16 * 16384,
            }
        ]
    }
    good = compare(
        "synthetic-pass", _synthetic_run("baseline", geo, kv), _synthetic_run("offload", geo, kv)
    )
    bad = compare(
        "synthetic-fail",
        _synthetic_run("baseline", geo, kv),
        _synthetic_run("offload", geo, kv, flip=True),
    )
    if good["status"] != "PASS" or bad["status"] != "FAIL":
        failures.append(f"report self-test: {good['status']}/{bad['status']} != PASS/FAIL")
    print("\nreport self-test (synthetic results, not measurements):")
    print(render_table([good, bad]))
    report["self_test"] = [good, bad]
    report["failures"] = failures
    report["status"] = "dry-run-ok" if not failures else "dry-run-fail"
    (workdir / "dry-run.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    for msg in failures:
        print(f"FAIL {msg}")
    print(f"\ndry run: {'OK' if not failures else 'FAIL'} (configs in {workdir / 'models'})")
    return 0 if not failures else 1


def _dry_vllm(
    harness: Any, spec: ModelSpec, geo: Geometry, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """vLLM's own config + KV planning on the CPU (tests/contract/vllm_harness.py)."""
    from vllm.config import KVTransferConfig, ModelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    problems: list[str] = []
    mc = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=geo.max_model_len,
    )
    KVTransferConfig(**kv_transfer_config(args))
    # the exact engine arguments of both runs must make a VllmConfig
    for mode in ("baseline", "offload"):
        kw = engine_kwargs(spec, mode, geo, model_dir, args)
        if "kv_transfer_config" in kw:
            kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
        EngineArgs(**kw).create_engine_config()
    case = harness.Case(
        model=spec.name,
        gpu="h200",
        max_model_len=geo.max_model_len,
        block_size=spec.block_size,
        dtype="bfloat16",
    )
    layout = harness.build_layout(spec.config, case, "FLASH_ATTN")
    if layout.block_size != spec.block_size:
        problems.append(f"vLLM moved the block size {spec.block_size} -> {layout.block_size}")
    if geo.prefix_tokens % layout.block_size:
        problems.append(
            f"prefix {geo.prefix_tokens} is not a multiple of block {layout.block_size}"
        )
    vc = layout.vllm_config
    kinds = {"full_attention": "F", "sliding_window": "S", "mamba": "M"}
    desc: dict[str, int] = {}
    for g in layout.groups:
        k = kinds.get(g["kind"].split(":")[-1], "?")
        desc[k] = desc.get(k, 0) + 1
    num_blocks, fit = {}, {}
    specs = {}
    for g in layout.kv_cache_config.kv_cache_groups:
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for n in g.layer_names:
            specs[n] = per_layer[n] if per_layer else g.kv_cache_spec
    groups = get_global_kv_cache_groups(vc, [specs])
    # blocks one request of the workload holds in each group (prefix caching keeps them)
    tokens = geo.prefix_tokens + geo.suffix_tokens + geo.max_tokens
    per_request = 0
    for g in layout.groups:
        tpb = g["tokens_per_block"]
        full = math.ceil(tokens / tpb)
        if g["kind"].endswith("sliding_window") and g["sliding_window"]:
            full = min(full, math.ceil((g["sliding_window"] - 1) / tpb) + 1)
        per_request += full
    for mode in ("baseline", "offload"):
        mem = geo.kv_bytes(spec, mode)
        cfg = get_kv_cache_configs(vc, [specs], [mem], groups)[0]
        num_blocks[mode] = cfg.num_blocks
        fit[mode] = cfg.num_blocks / per_request
    if fit["offload"] * 2 > geo.prefixes:
        problems.append(
            f"offload GPU pool holds ~{fit['offload']:.1f} prompts: the working set "
            f"({geo.prefixes}) is not at least twice that, eviction is not certain"
        )
    if fit["baseline"] < 3 * geo.prefixes + 1:
        problems.append(f"baseline GPU pool holds ~{fit['baseline']:.1f} prompts < working set")
    if any(g["kind"].endswith("mamba") for g in layout.groups) and not mc.is_hybrid:
        problems.append("vLLM does not see the Qwen3-Next config as hybrid")
    connector = _dry_connector_geometry(layout, args)
    if connector.get("refused"):
        problems.append(f"the Spillway connector refuses it: {connector['refused']}")
    return {
        "architecture": mc.architecture,
        "is_hybrid": mc.is_hybrid,
        "block_size": layout.block_size,
        "groups": layout.groups,
        "groups_desc": f"{len(layout.groups)} ("
        + " ".join(f"{k}{n}" for k, n in sorted(desc.items()))
        + ")",
        "num_blocks": num_blocks,
        "blocks_per_request": per_request,
        "prompts_fit": fit,
        "connector": connector,
        "problems": problems,
    }


def _dry_connector_geometry(layout: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Spillway's chunk geometry for vLLM's CPU plan: would the connector start?"""
    try:
        from spillway_engine.offloader.geometry import SpillwayConfigError, build_geometry
    except Exception as exc:  # the connector is still being written
        return {"skipped": f"spillway_engine.offloader.geometry: {exc!r}"}
    transfer = layout.vllm_config.kv_transfer_config
    transfer.kv_connector_extra_config = dict(kv_transfer_config(args)["kv_connector_extra_config"])
    try:
        geometry = build_geometry(layout.vllm_config, layout.kv_cache_config)
    except SpillwayConfigError as exc:
        return {"refused": str(exc)}
    except Exception as exc:
        return {"skipped": f"build_geometry raised {exc!r}"}
    host = geometry.layout
    return {
        "chunk_tokens": host.chunk_tokens,
        "offloaded_groups": [g.group_id for g in host.groups],
        "blocks_per_chunk": [g.blocks_per_chunk for g in host.groups],
        "unit_bytes": host.unit_bytes,
        "num_units": host.num_units,
    }


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write and validate the configs (CPU), self-test the report; no GPU",
    )
    p.add_argument("--no-vllm", action="store_true", help="dry run: transformers checks only")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="only say whether this Python can run the GPU check",
    )
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "spillway-gpu-check"))
    p.add_argument("--jobs", type=int, default=2, help="runs at a time on the one GPU")
    p.add_argument(
        "--inproc",
        action="store_true",
        help="engine core in the child's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    )
    p.add_argument("--timeout-per-run", type=float, default=240.0)
    p.add_argument("--budget-s", type=float, default=420.0, help="whole check, all runs")
    p.add_argument("--prefixes", type=int, default=24, help="distinct prefixes (working set)")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="spillway_chunk_tokens (0: leave it to the connector)",
    )
    p.add_argument("--cpu-gib", type=float, default=2.0, help="host tier size (cpu_bytes_to_use)")
    p.add_argument(
        "--gdn-prefill-backend",
        default="triton",
        choices=("triton", "flashinfer", "auto"),
        help="Qwen3-Next GDN prefill kernel (auto: FlashInfer on Hopper)",
    )
    p.add_argument("--child", choices=sorted(MODELS), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("baseline", "offload"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in args.models if m not in MODELS]
        if unknown or not args.models:
            p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return fake_child_main(args) if args.fake else child_main(args)
    if args.dry_run:
        return dry_run(args)
    if args.preflight:
        problems = preflight()
        print(
            "gpu-offload-check: ready"
            if not problems
            else "gpu-offload-check: cannot run: " + "; ".join(problems)
        )
        return 0 if not problems else 3
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
