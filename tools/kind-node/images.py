"""The kind node image's preloaded control-plane images, written without docker or a
registry by e2e/nodes/ociimage.py (the real nodes' pause and test images come from the
same code): one OCI image-layout archive per image, each one layer holding busybox-static
(/bin/busybox and its applets, for `kubectl exec` and probes) and one binary.

    images.py OUTDIR REF=BINARY[@DEST][!ENTRYPOINT] ...

writes OUTDIR/<n>.tar for each: BINARY at DEST (default /usr/local/bin/<name>, on the
image's PATH: kubeadm's static pods name their command, e.g. `kube-apiserver`), and, with
!ENTRYPOINT, that path as the image's entrypoint (CoreDNS: kubeadm gives only its args).
REF=pause is the pod sandbox: busybox `sleep` as PID 1. Deterministic (fixed mtimes,
sorted entries): the same inputs give the same digests. tools/kind-node.sh imports the
archives into the node image's containerd store (`ctr -n k8s.io images import`).

Run with the host's python3: ociimage.py (standard library only) is loaded from its file,
not through the e2e package, whose other modules need the project's venv.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "ociimage", Path(__file__).resolve().parents[2] / "e2e" / "nodes" / "ociimage.py")
# registered before it runs: its dataclasses look their module up in sys.modules
ociimage = sys.modules["ociimage"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ociimage)

#: Directories kind's images have beside ociimage's own (/run for the node's daemons).
EXTRA_DIRS = ("run", "usr/local", "usr/local/bin")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    try:
        for n, spec in enumerate(argv[1:]):
            ref, _, what = spec.partition("=")
            what, _, entrypoint = what.partition("!")
            if what == "pause":
                ociimage.write_image(out / f"{n}.tar", ref, ociimage.PAUSE_CMD,
                                     ociimage.busybox_layer(extra_dirs=EXTRA_DIRS))
                continue
            binary, _, dest = what.partition("@")
            path = Path(binary)
            dest = dest or f"/usr/local/bin/{path.name}"
            ociimage.write_image(
                out / f"{n}.tar", ref, [], ociimage.busybox_layer(
                    static={dest: path}, extra_dirs=EXTRA_DIRS),
                entrypoint=[entrypoint] if entrypoint else None)
    except ociimage.ImageError as exc:
        print(f"{ref}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
