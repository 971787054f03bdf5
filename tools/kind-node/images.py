"""The kind node image's preloaded control-plane images, written without docker or a
registry: one OCI image-layout archive per image, each one layer holding busybox-static
(/bin/busybox and its applets, for `kubectl exec` and probes) and one binary.

    images.py OUTDIR REF=BINARY[@DEST][!ENTRYPOINT] ...

writes OUTDIR/<n>.tar for each: BINARY at DEST (default /usr/local/bin/<name>, on the
image's PATH: kubeadm's static pods name their command, e.g. `kube-apiserver`), and, with
!ENTRYPOINT, that path as the image's entrypoint (CoreDNS: kubeadm gives only its args).
REF=pause is the pod sandbox: busybox `sleep` as PID 1. Deterministic (fixed mtimes,
sorted entries): the same inputs give the same digests. tools/kind-node.sh imports the
archives into the node image's containerd store (`ctr -n k8s.io images import`).
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

BUSYBOX = Path("/usr/bin/busybox")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def add(tar: tarfile.TarFile, name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644,
        data: bytes = b"", linkname: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, 0, 0, 0
    info.uname = info.gname = "root"
    info.linkname = linkname
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


def layer(binary: Path | None, dest: str | None) -> bytes:
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    dirs = {"bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "usr/local",
            "usr/local/bin", "var", "run"}
    if dest:
        parent = Path(dest.lstrip("/")).parent
        dirs |= {str(p) for p in (parent, *parent.parents)} - {"."}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            add(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
        add(tar, "tmp", kind=tarfile.DIRTYPE, mode=0o1777)
        add(tar, "bin/busybox", mode=0o755, data=BUSYBOX.read_bytes())
        for applet in sorted(set(applets) - {"busybox"}):
            if "/" not in applet:
                add(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, linkname="busybox")
        add(tar, "etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"
            b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        add(tar, "etc/group", data=b"root:x:0:\nnogroup:x:65534:\n")
        if binary is not None and dest:
            add(tar, dest.lstrip("/"), mode=0o755, data=binary.read_bytes())
    return buf.getvalue()


def write(archive: Path, ref: str, config_extra: dict, layer_bytes: bytes) -> None:
    layer_digest = sha(layer_bytes)
    config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [PATH_ENV], "WorkingDir": "/", **config_extra},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tools/kind-node/images.py"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer_bytes)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(manifest_bytes), "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]},
        }],
    }
    blobs = {sha(b): b for b in (layer_bytes, config_bytes, manifest_bytes)}
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}')
        add(tar, "index.json", data=json.dumps(index, sort_keys=True).encode())
        add(tar, "blobs", kind=tarfile.DIRTYPE, mode=0o755)
        add(tar, "blobs/sha256", kind=tarfile.DIRTYPE, mode=0o755)
        for digest in sorted(blobs):
            add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data=blobs[digest])
    tmp.replace(archive)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    if not BUSYBOX.is_file():
        print(f"{BUSYBOX} missing (Debian package busybox-static, tools/host.sh)", file=sys.stderr)
        return 1
    for n, spec in enumerate(argv[1:]):
        ref, _, what = spec.partition("=")
        what, _, entrypoint = what.partition("!")
        if what == "pause":
            write(out / f"{n}.tar", ref, {"Cmd": ["/bin/sleep", "2147483647"]}, layer(None, None))
            continue
        binary, _, dest = what.partition("@")
        path = Path(binary)
        if not path.is_file():
            print(f"{ref}: binary {binary} missing", file=sys.stderr)
            return 1
        dest = dest or f"/usr/local/bin/{path.name}"
        extra = {"Entrypoint": [entrypoint]} if entrypoint else {}
        write(out / f"{n}.tar", ref, extra, layer(path, dest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
