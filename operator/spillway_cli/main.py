"""The ``spillway`` command. Subcommands register themselves in ``_SUBCOMMANDS``.

Exit status: 0 on success, 2 on a refusal or bad input (one line on stderr, or an
``{"error": ...}`` object with ``--format json``), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from spillway_engine.planner.families import HOW_TO_ASK, SUPPORTED_ARCHITECTURES
from spillway_engine.planner.gpus import GPUS
from spillway_engine.planner.kv_layout import parse_pp_layer_partition
from spillway_engine.planner.model_config import ModelConfigSourceError, load_hub, load_local
from spillway_engine.planner.plan import Plan, PlanRefused, PlanRequest, make_plan
from spillway_engine.planner.shape import UnsupportedModel
from spillway_engine.quantity import QuantityError, human_bytes, parse_bytes

EXIT_REFUSED = 2


class CliError(Exception):
    """Bad input or a refusal: printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _quantity(text: str) -> int:
    try:
        value = parse_bytes(text)
    except QuantityError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 bytes")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that exits with status 2 and one line, as every refusal does."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{self.prog}: {message}")


# ---------------------------------------------------------------------------- plan


def _plan_epilog() -> str:
    """The architectures ``spillway plan`` knows, and how to ask for another."""
    known = textwrap.fill(
        ", ".join(SUPPORTED_ARCHITECTURES), width=78, initial_indent="  ", subsequent_indent="  "
    )
    ask = textwrap.fill(
        f"Any other architecture is refused with the reason. To ask for one, {HOW_TO_ASK}.",
        width=78,
    )
    return f"supported architectures (config.json 'architectures'):\n{known}\n\n{ask}"


def _add_plan(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="KV groups, offload chunks, host pool and pod memory for a model",
        description="Compute the KV-cache groups vLLM 0.33.0 builds for a model, the "
        "offload chunk geometry, the host pool and the pod memory.",
        epilog=_plan_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", metavar="PATH", help="config.json or a model directory")
    src.add_argument("--model", metavar="ID", help="Hugging Face model id (config.json only)")
    p.add_argument("--revision", help="hub revision for --model")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1)
    p.add_argument("--nodes", type=_positive_int, default=1,
                   help="nodes one engine spans (vLLM --nnodes: its TP x PP ranks split "
                   "evenly); the pod figures are then per node")
    p.add_argument(
        "--pp-layer-partition",
        metavar="N,N,...",
        help="decoder layers per pipeline stage, as vLLM's VLLM_PP_LAYER_PARTITION "
        "(default: vLLM's own split)",
    )
    p.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1)
    p.add_argument("--max-model-len", type=_positive_int)
    p.add_argument("--block-size", type=_positive_int, help="vLLM --block-size, if forced")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16"), default="auto")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla "
                        "(another of vLLM's is refused with its reason)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--blocks-per-chunk", type=_int, help="GPU blocks per offload chunk")
    p.add_argument("--cpu-memory", type=_quantity, help="host pool (64Gi, bytes), per engine")
    p.add_argument(
        "--cpu-memory-per",
        choices=("engine", "pod"),
        default="engine",
        help="--cpu-memory is each data-parallel engine's pool (default) or the pod's, "
        "split across its engines",
    )
    p.add_argument("--memory-limit", type=_quantity, help="container memory limit to fit")
    p.add_argument("--offloader", choices=("upstream", "spillway"), default="spillway")
    p.add_argument("--disk", type=_quantity,
                   help="a disk tier under the host pool: the pod's volume (200Gi, bytes)")
    p.add_argument("--disk-writers", type=_positive_int, default=1,
                   help="pods sharing the --disk volume, each keeping an equal share")
    p.add_argument("--gpu", default="h100",
                   help="a GPU of the planner's catalogue: " + ", ".join(GPUS)
                   + " (default h100; case-insensitive, aliases and GFD product labels too)")
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        help='vLLM --speculative-config, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\' '
        "(the model's MTP heads add their cache layers to the groups), or method draft_model "
        "/ eagle3 with the drafter's hub id as model",
    )
    p.add_argument(
        "--draft-config",
        metavar="PATH",
        help="the drafter's config.json (file or directory) for draft_model / eagle3, "
        "instead of fetching it for the speculative config's model",
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(handler=_run_plan)


def _speculative_config(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON, reduced to the keys that change the KV layout."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(value) - {"method", "num_speculative_tokens", "model"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"keys {unknown} are not modelled (method, num_speculative_tokens, model)"
        )
    if value.get("method") not in ("mtp", "draft_model", "eagle3"):
        raise argparse.ArgumentTypeError(
            f"method {value.get('method')!r} is not modelled; mtp (the model's own MTP "
            "heads), draft_model and eagle3 (with the drafter's model) are"
        )
    if "model" in value and not isinstance(value["model"], str):
        raise argparse.ArgumentTypeError("model must be the drafter's id or path (a string)")
    tokens = value.get("num_speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise argparse.ArgumentTypeError("num_speculative_tokens must be a positive integer")
    return value


def _load_config(args: argparse.Namespace) -> dict[str, Any]:
    try:
        if args.model_config:
            return load_local(args.model_config)
        return load_hub(args.model, revision=args.revision, token=os.environ.get("HF_TOKEN"))
    except ModelConfigSourceError as e:
        raise CliError(str(e)) from None


def _load_draft_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The drafter's config.json: --draft-config, else the speculative config's model."""
    speculative = args.speculative_config or {}
    if speculative.get("method") not in ("draft_model", "eagle3"):
        if args.draft_config:
            raise CliError("--draft-config is for --speculative-config method draft_model "
                           "or eagle3")
        return None
    try:
        if args.draft_config:
            return load_local(args.draft_config)
        if "model" in speculative:
            return load_hub(speculative["model"], token=os.environ.get("HF_TOKEN"))
    except ModelConfigSourceError as e:
        raise CliError(str(e)) from None
    return None  # the planner says it needs the drafter's config.json


def _run_plan(args: argparse.Namespace) -> int:
    if args.cpu_memory is None and args.memory_limit is None:
        raise CliError("give --cpu-memory (the host pool) or --memory-limit")
    config = _load_config(args)
    draft_config = _load_draft_config(args)
    partition = None
    if args.pp_layer_partition is not None:
        try:
            partition = list(parse_pp_layer_partition(args.pp_layer_partition))
        except UnsupportedModel as e:
            raise CliError(str(e)) from None
    request = PlanRequest(
        model_name=args.model or args.model_config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_layer_partition=partition,
        data_parallel_size=args.data_parallel_size,
        nodes=args.nodes,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        blocks_per_chunk=args.blocks_per_chunk,
        cpu_memory_bytes=args.cpu_memory,
        host_memory_scope=args.cpu_memory_per,
        memory_limit_bytes=args.memory_limit,
        offloader=args.offloader,
        disk_bytes=args.disk,
        disk_writers=args.disk_writers,
        gpu=args.gpu,
        speculative_method=(args.speculative_config or {}).get("method"),
        num_speculative_tokens=(args.speculative_config or {}).get("num_speculative_tokens", 0),
        speculative_model=(args.speculative_config or {}).get("model") or args.draft_config,
    )
    try:
        plan = make_plan(config, request, draft_config)
    except PlanRefused as e:
        raise CliError(e.reason) from None
    if args.format == "json":
        print(plan.model_dump_json(indent=2))
    else:
        print(render_table(plan))
    return 0


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += [
        "  ".join(
            c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths, strict=True)
        )
        for r in cells
    ]
    return out


def _disk_lines(plan: Plan) -> list[str]:
    d = plan.disk
    if d is None:
        return ["Disk tier  none (offload.disk)"]
    shared = f", shared by up to {d.writers} pods" if d.writers > 1 else ""
    return [
        f"Disk tier  {human_bytes(d.volume_bytes)} volume{shared}; per engine "
        f"{human_bytes(d.volume_bytes_per_engine)}, budget {human_bytes(d.budget_bytes_per_engine)}"
        f" of chunk files ({', '.join(human_bytes(b) for b in d.file_bytes)} per chunk of "
        f"each group), {d.num_chunks} chunks, {d.capacity_tokens} tokens per engine",
        f"           files under <volume>/{d.cache_key}, prefix hash {d.hash_algo}",
        f"Held       host {plan.capacity_tokens} + disk {d.capacity_tokens} = "
        f"{plan.capacity_tokens + d.capacity_tokens} tokens per engine",
    ]


def _nodes_text(par: Any) -> str:
    """How the replica's ranks sit on its nodes: one engine's ranks split evenly, or
    (data parallelism across nodes) whole engines a node."""
    if par.nodes == 1:
        return ""
    if par.data_parallel_size > 1:
        local = par.data_parallel_size // par.nodes
        return (f", {par.nodes} nodes of {local} DP ranks (node r holds DP ranks "
                f"{local}r..{local}r+{local - 1}, each engine's {par.world_size} GPU(s) on "
                "its node)")
    local = par.world_size // par.nodes
    return (f", {par.nodes} nodes of {local} ranks "
            f"(node r holds ranks {local}r..{local}r+{local - 1})")


def render_table(plan: Plan) -> str:
    """A plan for people: groups, chunk geometry, pool, capacity, pod memory."""
    m, par = plan.model, plan.parallelism
    lines = [
        f"model      {m.name or '-'}  ({m.architecture}, {m.num_cache_layers} cache layers, "
        f"{m.dtype})",
        f"engine     vLLM {plan.vllm_version} on {plan.gpu.name} ({plan.gpu.generation}, "
        f"{plan.gpu.attention_backend or 'no attention'}), TP {par.tensor_parallel_size} "
        f"x PP {par.pipeline_parallel_size}, DP {par.data_parallel_size}"
        + _nodes_text(par),
        f"kv cache   {plan.kv_cache_dtype}, block size {plan.block_size}, "
        f"max_model_len {plan.max_model_len}, hash unit {plan.tokens_per_hash} tokens, "
        f"{human_bytes(plan.worker_bytes_per_block)} per block per rank",
        "",
        "KV-cache groups (one rank)",
    ]
    lines += _table(
        ("#", "kind", "layers", "tokens/block", "page bytes", "bytes/block", "window"),
        [
            (
                i,
                g.kind,
                g.num_layers,
                g.tokens_per_block,
                g.page_bytes,
                g.bytes_per_block,
                g.sliding_window or "-",
            )
            for i, g in enumerate(plan.kv_groups)
        ],
    )
    lines += _offloader_lines(plan)
    pod = plan.pod
    lines += [
        "",
        f"Pool ({plan.offloader})  {human_bytes(plan.cpu_memory_bytes)} per engine "
        f"(budget given per {pod.host_memory_scope}), "
        f"{human_bytes(pod.pool_bytes_per_engine)} mapped per engine, "
        f"{plan.num_chunks} chunks, {plan.capacity_tokens} tokens per engine",
        f"           {pod.engines} engine(s) per pod: "
        f"{human_bytes(pod.engines * pod.pool_bytes_per_engine)} mapped per pod",
        f"{'Pod' if plan.parallelism.nodes == 1 else 'Each node'}"
        f"{'        ' if plan.parallelism.nodes == 1 else '  '}/dev/shm "
        f"{human_bytes(pod.shm_bytes)}, memory request "
        f"{human_bytes(pod.memory_request_bytes)}, limit {human_bytes(pod.memory_limit_bytes)}",
        *_disk_lines(plan),
        f"extra cfg  {json.dumps(plan.kv_connector_extra_config)}",
    ]
    lines += _stage_lines(plan)
    lines += [f"note       {n}" for n in plan.notes]
    return "\n".join(lines)


def _offloader_lines(plan: Plan) -> list[str]:
    """Both offloaders' geometry: Spillway's per-group chunks and pool, vLLM's rows."""
    s = plan.spillway
    lines = ["", f"Spillway offloader: one chunk = {s.chunk_tokens} tokens in every group"]
    lines += _table(
        ("#", "blocks/chunk", "chunk bytes", "units", "slot bytes", "window chunks"),
        [
            (
                g.group_index,
                g.blocks_per_chunk,
                g.chunk_bytes,
                g.units,
                g.row_bytes,
                g.window_chunks if g.window_chunks is not None else "-",
            )
            for g in s.groups
        ],
    )
    lines.append(
        f"  {s.num_units} units x {human_bytes(s.unit_bytes * s.copies)} = "
        f"{human_bytes(s.region_bytes)}; {s.num_chunks} chunks of every group "
        f"({human_bytes(s.chunk_set_bytes)} each), capacity {s.capacity_tokens} tokens"
    )
    u = plan.upstream
    if u is None:
        return [*lines, "", f"vLLM offloader: refuses ({plan.upstream_refusal})"]
    return [
        *lines,
        "",
        f"vLLM offloader: {u.blocks_per_chunk} block(s) per chunk, every group key takes "
        f"a row of {human_bytes(u.row_bytes)}",
        f"  {u.num_chunks} rows = {human_bytes(u.region_bytes)}, capacity "
        f"{u.capacity_tokens} tokens (gauge at max_model_len: {u.gauge_tokens})",
    ]


def _stage_lines(plan: Plan) -> list[str]:
    """Per pipeline stage: its decoder layers, its share of each KV group, its workers'
    block and the host pool its workers map (the top-level figures are stage 0's)."""
    if not plan.stages:
        return []
    partition = plan.parallelism.pipeline_layer_partition
    how = f"VLLM_PP_LAYER_PARTITION={','.join(map(str, partition))}" if partition else (
        "vLLM's split"
    )
    lines = [
        "",
        f"Pipeline stages ({how}; figures above are stage 0's, which vLLM's scheduler uses)",
    ]
    lines += _table(
        ("stage", "decoder layers", "cache layers", "layers per group", "bytes/block",
         "chunks", "host pool"),
        [
            (
                s.stage,
                f"{s.first_layer}-{s.end_layer - 1}",
                s.num_cache_layers,
                "/".join(str(g.num_layers) for g in s.kv_groups),
                human_bytes(s.worker_bytes_per_block),
                _stage_chunks(plan, s),
                human_bytes(s.region_bytes),
            )
            for s in plan.stages
        ],
    )
    return lines


def _stage_chunks(plan: Plan, stage: Any) -> Any:
    chosen = stage.upstream if plan.offloader == "upstream" else stage.spillway
    return "-" if chosen is None else chosen.num_chunks


# ---------------------------------------------------------------------------- main

# ---------------------------------------------------------------------------- others


def _add_operator(sub: Any) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator")
    ops = p.add_subparsers(dest="operator_command", metavar="COMMAND", parser_class=_Parser)
    ops.required = True
    run = ops.add_parser("run", help="reconcile InferenceDeployments (kopf)")
    from spillway_operator.main import add_arguments
    from spillway_operator.main import run as run_operator

    add_arguments(run)
    run.set_defaults(handler=run_operator)


def _add_loadgen(sub: Any) -> None:
    from spillway_cli import loadgen

    loadgen.add_parser(sub).set_defaults(handler=loadgen.run)


_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_plan, _add_operator, _add_loadgen]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spillway", description="Spillway: vLLM with sized KV offloading.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _wants_json(argv: Sequence[str]) -> bool:
    args = list(argv)
    return "--format=json" in args or any(
        a == "--format" and i + 1 < len(args) and args[i + 1] == "json" for i, a in enumerate(args)
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        return int(args.handler(args))
    except CliError as e:
        if _wants_json(argv):
            print(json.dumps({"error": str(e)}))
        else:
            print(f"spillway: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (ValueError, OSError) as e:  # last line of defence: one line, never a traceback
        if _wants_json(argv):
            print(json.dumps({"error": str(e)}))
        else:
            print(f"spillway: {e}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
