"""The hash of what the images are built from: the files of the build context that the
Dockerfile copies (pyproject.toml, operator/, engine/, tools/images/) and the
Dockerfile itself. tools/images.sh labels each image with it (dev.spillway.source);
tests/images refuses an image built from another tree.

    source_hash.py ROOT     prints the hash
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

#: Paths (files, or folders ending in /) the hash covers, relative to the repository.
INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "operator/", "engine/",
          "tools/images/")


def _covered(path: str) -> bool:
    if "__pycache__/" in path or path.endswith((".pyc", ".pyo")):
        return False
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in INPUTS)


def files(root: Path) -> list[str]:
    """The covered files that exist: git's tracked and untracked-not-ignored ones (every
    file under the inputs, outside a git checkout)."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co",
                                 "--exclude-standard", "-z"], capture_output=True,
                                check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(root)) for p in root.rglob("*")]
    return sorted(p for p in set(listed) if p and _covered(p) and (root / p).is_file())


def source_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in files(root):
        digest.update(path.encode() + b"\0" + hashlib.sha256((root / path).read_bytes())
                      .hexdigest().encode() + b"\n")
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    print(source_hash(Path(sys.argv[1]).resolve()))
