"""``spillway-engine serve --emulate-gpu``: the planned launch on the emulated GPU.

The launcher knows nothing of the emulator. The command line
(:mod:`spillway_engine.cli`) adds these options to the serve parser and hands the
launcher this module's :func:`overlay`: the emulator's worker class, its environment
(KV budget, speed, parameter count) and its platform plug-in, nothing of the plan's
launch changed. An architecture the emulator cannot build is refused here, in one
line, before vLLM starts (:mod:`.refusals`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from spillway_engine import emulator
from spillway_engine.emulator.refusals import refusal
from spillway_engine.launcher.serve import EngineCliError, Overlay, positive
from spillway_engine.planner.plan import Plan
from spillway_engine.seam import EngineOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    emu = parser.add_argument_group("emulated GPU (no weights, no forward pass; for tests)")
    emu.add_argument(
        "--emulate-gpu",
        action="store_true",
        help="run the planned launch on an emulated GPU (spillway_engine.emulator)",
    )
    emu.add_argument(
        "--emulate-kv-bytes",
        type=positive(int),
        metavar="BYTES",
        help="emulated KV-cache budget (default: two max_model_len sequences, at least "
        f"{emulator.DEFAULT_KV_BYTES >> 20} MiB)",
    )
    emu.add_argument(
        "--emulate-speed",
        type=positive(float, zero=True),
        default=1.0,
        metavar="FACTOR",
        help="time factor on the modelled GPU step times: 1.0 real time, 0 no sleeping "
        "(default 1.0)",
    )
    emu.add_argument(
        "--emulate-model-params",
        type=positive(float),
        metavar="N",
        help="parameters per GPU the step times assume, e.g. 8e9 (default: counted from "
        "the served model)",
    )


def default_emulated_kv_bytes(plan: Plan) -> int:
    """A KV budget that holds two max_model_len sequences of every group (generous:
    windows and Mamba state counted per token), at least the emulator's default."""
    per_token = sum(g.bytes_per_block / g.tokens_per_block for g in plan.kv_groups)
    return max(emulator.DEFAULT_KV_BYTES, int(2 * plan.max_model_len * per_token))


def emulated_launch(
    plan: Plan,
    *,
    kv_bytes: int | None = None,
    speed: float = 1.0,
    model_params: float | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The vLLM arguments and environment that put the planned launch on the emulated
    GPU; both come from the emulator package, which owns their names."""
    env = emulator.emulator_env(
        default_emulated_kv_bytes(plan) if kv_bytes is None else kv_bytes, speed, model_params
    )
    return emulator.emulator_args(), env


def overlay(plan: Plan, options: EngineOptions, args: argparse.Namespace,
            argv: Sequence[str]) -> Overlay | None:
    """The emulated GPU's overlay on the launch, when ``--emulate-gpu`` asks for it."""
    if not args.emulate_gpu:
        if any(a.startswith("--emulate-") for a in argv):
            raise EngineCliError("the --emulate-* options need --emulate-gpu")
        return None
    refused = refusal(plan, options.offload_enabled)
    if refused is not None:
        raise EngineCliError(refused)
    more, env = emulated_launch(plan, kv_bytes=args.emulate_kv_bytes, speed=args.emulate_speed,
                                model_params=args.emulate_model_params)
    return Overlay(
        args=tuple(more), env=env, plugins=(emulator.PLATFORM_PLUGIN_NAME,),
        notes=("emulated GPU: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())),),
        pins=False)
