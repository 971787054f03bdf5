"""Tiny OCI images written by Python, without docker or a registry.

One layer holds busybox-static (``/bin/busybox``, Debian's ``busybox-static``) and a
symlink per applet, plus the few directories and files a container expects; the image
is written as an OCI image-layout archive (``oci-layout``, ``index.json``, blobs) that
``ctr images import`` reads. The pod sandbox (pause) image runs busybox ``sleep`` as
PID 1; the test image runs ``sh`` and also holds the host's ``openssl`` with the shared
libraries it loads: busybox's own TLS offers neither ECDSA nor the signature_algorithms
extension Go's TLS 1.2 server requires, so ``wget https://...`` to the API server only
works through ``openssl s_client``, which busybox wget uses when it finds it.

Everything is deterministic (fixed mtimes, sorted entries), so an image written twice
has the same digests and a node that holds it already needs no import.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/usr/bin/busybox")
OPENSSL = Path("/usr/bin/openssl")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"

# The pod sandbox image containerd's sandbox_image names: a container that sleeps as
# PID 1 (CRI stops sandboxes with SIGKILL, so PID 1 ignoring SIGTERM is fine).
PAUSE_REF = "spillway.local/pause:1"
PAUSE_CMD = ["/bin/sleep", "2147483647"]
# The test image: busybox's shell and applets (sh, wget, nc, httpd, df, ...).
BUSYBOX_REF = "spillway.local/busybox:1"
BUSYBOX_CMD = ["/bin/sh"]


class ImageError(RuntimeError):
    """An image cannot be written; the message names the missing piece."""


@dataclass(frozen=True)
class OCIImage:
    ref: str
    archive: Path
    manifest_digest: str
    config_digest: str  # what docker calls the image ID
    diff_ids: tuple[str, ...]


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(tar: tarfile.TarFile, name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644,
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


def _shared_libraries(binary: Path) -> list[Path]:
    """The paths ``ldd`` says ``binary`` loads its libraries (and loader) from."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = []
    for line in out.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0] if words else ""
        if path.startswith("/"):
            libs.append(Path(path))
    return libs


def busybox_layer(busybox: Path = BUSYBOX, binaries: tuple[Path, ...] = (),
                  static: dict[str, Path] | None = None,
                  extra_dirs: tuple[str, ...] = ()) -> bytes:
    """An uncompressed layer tar: busybox, its applet links, /etc basics, empty dirs
    (and ``extra_dirs``); each of ``binaries`` at its host path with the libraries it
    loads; and each static binary of ``static`` (path in the image -> file here) as it
    is."""
    if not busybox.is_file():
        raise ImageError(f"{busybox} not found: run tools/host.sh (it installs busybox-static)")
    extra: dict[str, bytes] = {}
    for binary in binaries:
        if not binary.is_file():
            raise ImageError(f"{binary} not found (Debian package openssl)")
        for path in (binary, *_shared_libraries(binary)):
            extra[str(path).lstrip("/")] = path.resolve().read_bytes()
    for target, source in (static or {}).items():
        if not source.is_file():
            raise ImageError(f"{source} not found (tools/build.sh builds it)")
        extra[target.lstrip("/")] = source.read_bytes()
    dirs = {str(Path(p).parent) for p in extra} - {"."}
    dirs |= {str(parent) for d in dirs for parent in Path(d).parents} - {"."}
    dirs |= set(extra_dirs)
    binary = busybox.read_bytes()
    listing = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True)
    applets = sorted({a for a in listing.stdout.split() if a and "/" not in a} - {"busybox"})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted({"bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "var",
                         "var/www"} | dirs):
            _add(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
        _add(tar, "tmp", kind=tarfile.DIRTYPE, mode=0o1777)
        _add(tar, "bin/busybox", mode=0o755, data=binary)
        for applet in applets:
            _add(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, linkname="busybox")
        _add(tar, "etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"
             b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        _add(tar, "etc/group", data=b"root:x:0:\nnogroup:x:65534:\n")
        _add(tar, "var/www/index.html", data=b"spillway busybox httpd\n")
        for path in sorted(extra):
            _add(tar, path, mode=0o755, data=extra[path])
    return buf.getvalue()


def write_image(archive: Path, ref: str, cmd: list[str], layer: bytes,
                user: str = "", entrypoint: list[str] | None = None) -> OCIImage:
    """Write an OCI image-layout tar for ``ref`` (``name:tag``) with one layer, run as
    ``user`` (numeric, for runAsNonRoot; empty: root); ``entrypoint`` for an image whose
    users give only arguments (kubeadm's CoreDNS)."""
    layer_digest = _sha(layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [PATH_ENV], "Cmd": cmd, "WorkingDir": "/",
                   **({"User": user} if user else {}),
                   **({"Entrypoint": entrypoint} if entrypoint else {})},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "e2e/nodes/ociimage.py"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": _sha(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER_TAR, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{
            "mediaType": MANIFEST,
            "digest": _sha(manifest_bytes),
            "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": tag},
        }],
    }
    blobs = {_sha(b): b for b in (layer, config_bytes, manifest_bytes)}
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}')
        _add(tar, "index.json", data=json.dumps(index, sort_keys=True).encode())
        _add(tar, "blobs", kind=tarfile.DIRTYPE, mode=0o755)
        _add(tar, "blobs/sha256", kind=tarfile.DIRTYPE, mode=0o755)
        for digest in sorted(blobs):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data=blobs[digest])
    tmp.replace(archive)
    return OCIImage(ref, archive, _sha(manifest_bytes), _sha(config_bytes), (layer_digest,))


def builtin_images(directory: Path) -> list[OCIImage]:
    """The pause image and the busybox test image, written under ``directory``."""
    return [
        write_image(directory / "pause.tar", PAUSE_REF, PAUSE_CMD, busybox_layer()),
        write_image(directory / "busybox.tar", BUSYBOX_REF, BUSYBOX_CMD,
                    busybox_layer(binaries=(OPENSSL,))),
    ]
