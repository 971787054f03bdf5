"""Requirement lines from pyproject.toml, for the Dockerfile's dependency layers and
tools/images.sh (standard library only: it runs on the image's python before anything
is installed, and on the host's).

    requirements.py PYPROJECT [EXTRA...]      the project's dependencies and those extras'
    requirements.py PYPROJECT --only EXTRA    that extra's alone
    requirements.py PYPROJECT --check-pins EXTRA CONSTRAINTS
        every ``name==version`` of EXTRA is pinned the same in CONSTRAINTS (exit 1 if not)

An extra may name the project's own extras (``spillway[router]``); they are expanded.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _canon(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)[1])


def extra(project: dict, name: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """The requirement lines of one extra, the project's own extras it names expanded."""
    if name in seen:
        return []
    out = []
    for req in project["optional-dependencies"][name]:
        own = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\[([^\]]+)\]\s*", req)
        if own and _canon(own[1]) == _canon(project["name"]):
            for inner in own[2].split(","):
                out += extra(project, inner.strip(), seen | {name})
        else:
            out.append(req)
    return out


def requirements(pyproject: Path, extras: list[str], *, base: bool = True) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    out = list(project["dependencies"]) if base else []
    for name in extras:
        out += [r for r in extra(project, name) if r not in out]
    return out


def pins(path: Path) -> dict[str, str]:
    """name -> version of a pip freeze / constraints file's ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if m:
            out[_canon(m[1])] = m[2]
    return out


def check_pins(pyproject: Path, name: str, constraints: Path) -> list[str]:
    """Why CONSTRAINTS does not pin EXTRA's ``==`` requirements as pyproject.toml does."""
    have = pins(constraints)
    bad = []
    for req in requirements(pyproject, [name], base=False):
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*(\S+)\s*", req)
        if m and have.get(_canon(m[1])) != m[2]:
            bad.append(f"{req} (constraints: {have.get(_canon(m[1]), 'none')})")
    return bad


def main(argv: list[str]) -> int:
    pyproject, rest = Path(argv[0]), argv[1:]
    if rest[:1] == ["--check-pins"]:
        bad = check_pins(pyproject, rest[1], Path(rest[2]))
        if bad:
            print(f"{rest[2]} does not pin pyproject.toml's [{rest[1]}]: " + "; ".join(bad),
                  file=sys.stderr)
        return 1 if bad else 0
    if rest[:1] == ["--only"]:
        print("\n".join(requirements(pyproject, rest[1:], base=False)))
        return 0
    print("\n".join(requirements(pyproject, rest)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
