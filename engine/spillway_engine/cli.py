"""The ``spillway-engine`` command: ``serve`` (the pod's entry point), ``simulate`` and
``drain``.

The engine's top floor: it wires the launcher (:mod:`spillway_engine.launcher.serve`)
with the stand-ins beside it, the emulated GPU (``serve --emulate-gpu``,
:mod:`spillway_engine.emulator.launch`) and the engine simulator
(:mod:`spillway_engine.simulator`), so that the flow (planner -> offloader -> launcher)
never imports them.

Exit status: 0 on success, 2 on any usage problem, bad plan or refusal, 3 when the
container cannot hold the plan (preflight). Either way one line on stderr, never a
traceback, and ``serve`` writes the same line to the container's termination message
(:mod:`spillway_engine.launcher.termination`). Once vLLM is exec'd its status is the pod's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from spillway_engine.emulator import launch as emulated
from spillway_engine.launcher import drain
from spillway_engine.launcher.serve import (
    EXIT_USAGE,
    PROG,
    EngineCliError,
    serve_main,
    serve_parser,
)
from spillway_engine.launcher.termination import write_termination_message


def serve(argv: Sequence[str]) -> int:
    parser = serve_parser()
    emulated.add_arguments(parser)
    return serve_main(argv, parser, emulated.overlay)


def simulate(argv: Sequence[str]) -> int:
    try:
        from spillway_engine.simulator.__main__ import simulate_main
    except ImportError as e:
        raise EngineCliError(f"the engine simulator is not available in this build: {e}") from None
    return simulate_main(list(argv))


_SUBCOMMANDS = {"serve": serve, "simulate": simulate, "drain": drain.drain_main}
_USAGE = f"usage: {PROG} {{serve,simulate,drain}} ... (see {PROG} <command> --help)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not args else sys.stdout)
        return EXIT_USAGE if not args else 0
    command, rest = args[0], args[1:]
    handler = _SUBCOMMANDS.get(command)
    if handler is None:
        print(f"{PROG}: error: unknown command {command!r}; {_USAGE}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return handler(rest)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except EngineCliError as e:
        line = f"{PROG}: error: {e}"
        print(line, file=sys.stderr)
        if command == "serve":  # the operator shows it (Degraded, EngineStartFailed)
            write_termination_message(line)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
