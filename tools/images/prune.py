"""Remove from an environment's site-packages the files a list names: for the CPU engine
image, the CUDA kernels, compilers and shared libraries that vLLM and torch ship and that
the emulated GPU never loads (tools/images/engine-cpu-prune.txt says which, and why).
Standard library only: it runs on the image's python in the layer that installs vLLM,
so what it removes never reaches a layer.

    prune.py LIST [--site DIR] [--record FILE] [--dry-run]

Each line of LIST that is not blank or a comment is a glob relative to site-packages
(``**`` matches folders at any depth); what follows `` #`` on a line is a comment. A
folder that matches goes whole. The rules it keeps:

* a glob that matches nothing fails (the list no longer fits the pins: revise it);
* a Python source or bytecode file is never removed (a module that is there imports
  or fails as it would without the prune; only what it loads at run time can be gone);
* the distributions' metadata stays, so ``pip freeze`` and ``pip check`` read the same.

``--record FILE`` writes the removed paths (relative to site-packages), one a line.
Prints the bytes freed per glob and in all on stderr.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

KEEP_SUFFIXES = (".py", ".pyc", ".pyi")


def globs(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def _python_files(path: Path) -> list[Path]:
    if path.is_dir() and not path.is_symlink():
        return [p for p in path.rglob("*") if p.suffix in KEEP_SUFFIXES]
    return [path] if path.suffix in KEEP_SUFFIXES else []


def plan(site: Path, patterns: list[str]) -> tuple[dict[str, list[Path]], list[str]]:
    """{glob: the paths it removes}, and why the list cannot be applied (if it cannot)."""
    matched: dict[str, list[Path]] = {}
    errors = []
    for pattern in patterns:
        if pattern.startswith("/") or ".." in pattern.split("/"):
            errors.append(f"{pattern}: not a path inside site-packages")
            continue
        hits = sorted(site.glob(pattern))
        if not hits:
            errors.append(f"{pattern}: matches nothing in {site}")
            continue
        for hit in hits:
            if ".dist-info" in hit.relative_to(site).parts[0]:
                errors.append(f"{pattern}: would remove metadata ({hit.relative_to(site)})")
            elif py := _python_files(hit):
                errors.append(f"{pattern}: would remove Python files "
                              f"({', '.join(str(p.relative_to(site)) for p in py[:3])})")
        matched[pattern] = hits
    return matched, errors


def prune(site: Path, patterns: list[str]) -> tuple[list[str], int]:
    """Remove what the globs match; (the removed paths relative to site, bytes freed)."""
    matched, errors = plan(site, patterns)
    if errors:
        raise SystemExit("prune: " + "; ".join(errors))
    removed, total = [], 0
    for pattern, hits in matched.items():
        freed = 0
        for hit in hits:
            if not hit.exists() and not hit.is_symlink():
                continue  # inside a folder an earlier glob removed
            freed += _size(hit)
            removed.append(str(hit.relative_to(site)))
            if hit.is_dir() and not hit.is_symlink():
                shutil.rmtree(hit)
            else:
                hit.unlink()
        total += freed
        print(f"prune: {freed / 1e6:8.1f} MB  {pattern}", file=sys.stderr)
    print(f"prune: {total / 1e9:.2f} GB freed in all", file=sys.stderr)
    return removed, total


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("list", type=Path)
    ap.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    ap.add_argument("--record", type=Path)
    ap.add_argument("--dry-run", action="store_true",
                    help="print what would go (and why the list cannot apply), remove nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        matched, errors = plan(args.site, globs(args.list.read_text()))
        total = 0
        for pattern, hits in matched.items():
            size = sum(_size(h) for h in hits)
            total += size
            print(f"{size / 1e6:8.1f} MB  {pattern} ({len(hits)})")
        print(f"{total / 1e9:.2f} GB in all (folders matched twice counted twice)")
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        return 1 if errors else 0
    removed, _ = prune(args.site, globs(args.list.read_text()))
    if args.record:
        args.record.write_text("".join(f"{p}\n" for p in removed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
