"""The size limits of the house: no file over 800 lines and no function over 80 in
``operator/`` and ``engine/``, but for the entries of :data:`EXCEPTIONS`, each with its
reason, which the README's layout section ("How the code is laid out") repeats.

A function's length runs from its ``def`` to its last line (decorators left out,
docstring and comments in); a function, method or nested function is listed by its
own name after its file's path. An entry that no longer exceeds its limit fails too, so the list
shrinks as pieces are split.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCOPE = ("operator", "engine")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80

#: "path" (a file over 800 lines) or "path::function" (over 80) -> why it may be.
EXCEPTIONS: dict[str, str] = {
    "engine/spillway_engine/vllm_cli.py::preprocess": (
        "a line-for-line port of vLLM 0.33.0's FlexibleArgumentParser rewriting, "
        "kept whole to be read against vLLM's own"
    ),
}


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(dotted name, lines) of every function and method, nested ones too."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            out.append((name, node.end_lineno - node.lineno + 1))
            out += _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            out += _functions(node, prefix + node.name + ".")
        else:
            out += _functions(node, prefix)
    return out


def oversized(root: Path = ROOT) -> dict[str, int]:
    """Every file and function over its limit in ``SCOPE``: entry -> lines."""
    found = {}
    for top in SCOPE:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            if (n := len(text.splitlines())) > MAX_FILE_LINES:
                found[rel] = n
            for name, n in _functions(ast.parse(text)):
                if n > MAX_FUNCTION_LINES:
                    found[f"{rel}::{name.rpartition('.')[2]}"] = n
    return found


OVERSIZED = oversized()


def test_nothing_is_over_the_limits_but_the_listed():
    unlisted = sorted(f"{entry} ({n} lines)" for entry, n in OVERSIZED.items()
                      if entry not in EXCEPTIONS)
    assert unlisted == [], (
        "over 800 lines a file or 80 a function; split it, or list it with the reason "
        "in EXCEPTIONS and in the README's layout section:\n" + "\n".join(unlisted))


def test_every_exception_is_still_needed():
    stale = sorted(entry for entry in EXCEPTIONS if entry not in OVERSIZED)
    assert stale == [], f"within the limits now, drop from EXCEPTIONS and the README: {stale}"


def test_the_readme_lists_every_exception_with_its_reason():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("**How the code is laid out.**")
    section = readme[start : readme.index("\n## ", start)]
    missing = sorted(entry for entry, why in EXCEPTIONS.items()
                     if f"`{entry}`: {why}" not in " ".join(section.split()))
    assert missing == [], f"the README's layout section lacks: {missing}"


def test_the_measure_can_fail(tmp_path: Path):
    """A made-up tree: a long file and a long method are found, short ones are not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "big.py").write_text(
        "class A:\n    def long(self):\n" + "\n".join("    " + line for line in body.splitlines())
        + "\n\n    def short(self):\n        return 1\n" + "#\n" * 720)
    (tmp_path / "operator").mkdir()
    (tmp_path / "operator" / "small.py").write_text("def f():\n    return 1\n")
    assert oversized(tmp_path) == {"engine/big.py": 806, "engine/big.py::long": 82}


#: Everywhere else (bench/, e2e/, tests/, tools/): files only, a looser limit.
ELSEWHERE = ("bench", "e2e", "tests", "tools")
MAX_OTHER_FILE_LINES = 1000
#: path -> why it may be longer.
OTHER_EXCEPTIONS: dict[str, str] = {
    "e2e/gpu/offload_check.py": (
        "the prepared check for the lent GPU machine, run there as one script"
    ),
}


def long_files(root: Path = ROOT) -> dict[str, int]:
    """Python files over MAX_OTHER_FILE_LINES outside operator/ and engine/."""
    found = {}
    for top in ELSEWHERE:
        for path in sorted((root / top).rglob("*.py")):
            if (n := len(path.read_text().splitlines())) > MAX_OTHER_FILE_LINES:
                found[path.relative_to(root).as_posix()] = n
    return found


def test_no_file_elsewhere_is_over_a_thousand_lines():
    found = long_files()
    unlisted = sorted(f"{p} ({n} lines)" for p, n in found.items() if p not in OTHER_EXCEPTIONS)
    assert unlisted == [], "over 1000 lines; split it by role:\n" + "\n".join(unlisted)
    assert sorted(set(OTHER_EXCEPTIONS) - set(found)) == [], "within the limit now: drop it"


def test_long_files_finds_a_long_file(tmp_path: Path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "long.py").write_text("#\n" * 1001)
    (tmp_path / "bench" / "short.py").write_text("#\n" * 1000)
    assert long_files(tmp_path) == {"bench/long.py": 1001}
