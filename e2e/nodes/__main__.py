"""``python -m e2e.nodes load REF... | preload [REF...] | status | down``: the real
nodes' image loader and a last-resort cleanup.

``load`` moves images from the project's docker daemon ($SPILLWAY_DOCKER_HOST, default
tools/images.sh's: unix://$SPILLWAY_RUN_DIR/docker.sock, /run/spillway by
default) into every running real node; ``preload`` puts them in
the nodes' kept containerd roots whether the nodes run or not (default: the operator and
engine images tools/images.sh built; ``make demo`` runs it while the Go builds run);
``down`` undoes the machine's real nodes whichever cluster owns them
(``e2e/cluster/down`` does it for its own cluster, with the control plane). Exit status:
0 ok, 1 failed (the message says why).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from e2e.nodes.images import DOCKER_HOST, load_image, preload
from e2e.nodes.realnodes import NodeError, RealNodes, node_names

ROOT = Path(__file__).resolve().parents[2]


def _built_refs() -> tuple[list[str], str]:
    """The operator and engine refs tools/images.sh built (``--refs`` builds nothing), and
    the daemon that holds them."""
    done = subprocess.run([str(ROOT / "tools" / "images.sh"), "--refs"], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"tools/images.sh --refs failed: {done.stderr.strip()[-500:]}")
    refs = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return [refs["operator"], refs["engine"]], refs["DOCKER_HOST"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.nodes",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="docker image(s) -> every real node's containerd")
    load.add_argument("refs", nargs="+")
    load.add_argument("--docker-host", default=DOCKER_HOST)
    load.add_argument("--keep-layers", action="store_true",
                      help="keep the layer blobs after unpacking (default: free them)")
    load.add_argument("--one-at-a-time", action="store_true",
                      help="one docker save per node, freeing each node's blobs before the "
                           "next: less disk at once for a big image, slower (default: all "
                           "nodes from one save when the disk holds it)")
    pre = sub.add_parser("preload", help="docker image(s) -> the nodes' kept containerd "
                         "roots, running or not (default: tools/images.sh's operator and "
                         "engine)")
    pre.add_argument("refs", nargs="*")
    pre.add_argument("--nodes", type=int, default=2)
    pre.add_argument("--docker-host", help="default: tools/images.sh's daemon when no REF "
                     f"is given, else {DOCKER_HOST}")
    sub.add_parser("status", help="who owns the machine's real nodes")
    sub.add_parser("down", help="remove the machine's real nodes, whoever owns them")
    args = parser.parse_args(argv)
    try:
        if args.command == "load":
            for ref in args.refs:
                t0 = time.monotonic()
                result = load_image(ref, docker_host=args.docker_host,
                                    free_layers=not args.keep_layers,
                                    parallel=False if args.one_at_a_time else None)
                states = ", ".join(f"{n} {s}" for n, s in sorted(result.items()))
                print(f"{ref}: {states} ({time.monotonic() - t0:.1f}s)")
            return 0
        if args.command == "preload":
            t0 = time.monotonic()
            refs, host = (args.refs, DOCKER_HOST) if args.refs else _built_refs()
            result = preload(refs, node_names(args.nodes), docker_host=args.docker_host or host)
            for ref, states in result.items():
                print(f"{ref}: " + ", ".join(f"{n} {s}" for n, s in sorted(states.items())))
            print(f"preloaded in {time.monotonic() - t0:.1f}s")
            return 0
        if args.command == "status":
            record = RealNodes.read_record()
            if not record:
                print("no real nodes on this machine")
                return 1
            alive = "running" if RealNodes.record_alive(record) else "dead (run down)"
            print(f"{', '.join(record['nodes'])}: {alive}, owned by the cluster in "
                  f"{record['owner']}")
            return 0
        owner = RealNodes.cleanup_any()
        print(f"removed the real nodes of {owner}" if owner else "no real nodes to remove")
        return 0
    except NodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
