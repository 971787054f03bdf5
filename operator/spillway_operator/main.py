"""`spillway operator run`: the operator process.

Namespace-scoped (``-n NS``, repeatable) or cluster-wide (``--all-namespaces``);
a liveness endpoint for the kubelet, structured (JSON) logs if asked, and the
operator's Prometheus metrics on their own port.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces",
                       help="watch only this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (needs cluster-wide RBAC)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL ('' to disable)")
    parser.add_argument("--metrics-port", type=int, default=8081,
                        help="port of the operator's /metrics (0 to disable)")
    parser.add_argument("--log-format", choices=["plain", "json", "full"], default="plain")
    parser.add_argument("-v", "--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    # Imported here so that `spillway plan` never pays for kopf.
    import kopf
    from prometheus_client import start_http_server

    import spillway_operator.handlers  # noqa: F401 - registers the handlers

    if args.metrics_port:
        start_http_server(args.metrics_port)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()])
    if not args.verbose:
        # kopf says "Handler ... succeeded" for every watch event; Spillway logs what
        # changed and what failed itself.
        import logging

        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kopf.run(
        standalone=True,
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespaces or [],
        liveness_endpoint=args.liveness or None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillway operator run", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
