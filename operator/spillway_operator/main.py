"""`spillway operator run`: the operator process.

Namespace-scoped (``-n NS``, repeatable) or cluster-wide (``--all-namespaces``);
a liveness endpoint for the kubelet, structured (JSON) logs if asked, and the
operator's Prometheus metrics on their own port.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spillway_operator.plumbing.leader import Election

# A namespace is a DNS label; the operator's own watches take names, not kopf's globs.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


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
    env = os.environ
    parser.add_argument(
        "--endpoint-picker", metavar="[NAMESPACE/]SERVICE:PORT",
        default=env.get("SPILLWAY_ENDPOINT_PICKER") or None,
        help="the Service (and its port) of spillway-router's endpoint picker (--epp-port): "
             "each InferenceDeployment gets a Gateway API Inference Extension InferencePool "
             "naming it, when the cluster serves that API; with NAMESPACE, only "
             "InferenceDeployments there (an InferencePool names a Service of its own "
             "namespace). Default: SPILLWAY_ENDPOINT_PICKER; unset, no InferencePools")
    le = parser.add_argument_group(
        "leader election", "several replicas; only the holder of a coordination.k8s.io/v1 "
        "Lease reconciles, autoscales and writes (defaults from SPILLWAY_* variables)")
    le.add_argument("--leader-elect", action=argparse.BooleanOptionalAction,
                    default=env.get("SPILLWAY_LEADER_ELECT", "").lower() in ("1", "true", "yes"),
                    help="stand for election on the Lease (SPILLWAY_LEADER_ELECT; off by default)")
    le.add_argument("--leader-election-namespace", metavar="NS",
                    default=env.get("SPILLWAY_LEADER_ELECTION_NAMESPACE")
                    or env.get("POD_NAMESPACE"),
                    help="namespace of the Lease (default: POD_NAMESPACE, else the in-cluster "
                         "ServiceAccount's namespace)")
    le.add_argument("--leader-election-id", metavar="NAME",
                    default=env.get("SPILLWAY_LEADER_ELECTION_ID", "spillway-operator"),
                    help="name of the Lease")
    le.add_argument("--leader-election-identity", metavar="ID",
                    default=env.get("SPILLWAY_LEADER_ELECTION_IDENTITY"),
                    help="this candidate's holderIdentity (default: POD_NAME or the host "
                         "name, then a random suffix)")
    le.add_argument("--lease-duration", type=float, metavar="SECONDS",
                    default=float(env.get("SPILLWAY_LEASE_DURATION", "15")),
                    help="how long standbys wait after the last renew before taking over")
    le.add_argument("--renew-deadline", type=float, metavar="SECONDS",
                    default=float(env.get("SPILLWAY_RENEW_DEADLINE", "10")),
                    help="a leader that has not renewed for this long stops writing")
    le.add_argument("--retry-period", type=float, metavar="SECONDS",
                    default=float(env.get("SPILLWAY_RETRY_PERIOD", "2")),
                    help="how often candidates and the leader try the Lease")


def election_of(args: argparse.Namespace) -> Election | None:
    """The election this process stands for, or None; ValueError for bad settings."""
    if not args.leader_elect:
        return None
    from spillway_operator.plumbing.leader import Election, LeaseTiming, default_identity

    namespace = args.leader_election_namespace
    if not namespace and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    if not namespace:
        raise ValueError("--leader-elect needs --leader-election-namespace (or POD_NAMESPACE)")
    timing = LeaseTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    identity = args.leader_election_identity or default_identity(os.environ.get("POD_NAME"))
    return Election(namespace, args.leader_election_id, identity, timing)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `spillway plan` never pays for kopf.
    import kopf
    from prometheus_client import start_http_server

    import spillway_operator.handlers  # noqa: F401 - registers the handlers

    try:
        for namespace in args.namespaces or ():
            if not _NAMESPACE.fullmatch(namespace):
                raise ValueError(f"-n {namespace!r}: not a namespace name (lowercase letters, "
                                 "digits and '-', at most 63; patterns are not supported)")
        election = election_of(args)
        picker = None
        if args.endpoint_picker:
            from spillway_operator.flow.routing import parse_endpoint_picker

            picker = parse_endpoint_picker(args.endpoint_picker)
    except ValueError as exc:
        print(f"spillway operator run: {exc}", file=sys.stderr)
        return 2
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
        memo=kopf.Memo(election=election, namespaces=args.namespaces or None,
                       endpoint_picker=picker),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillway operator run", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
