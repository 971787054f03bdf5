"""The operator image as the chart runs it (charts/spillway/templates/deployment.yaml and
router.yaml): user 1000, read-only root filesystem, no capabilities, no network. It has
no vLLM and no torch, and everything the operator, the router and the `spillway`
command import (at module level or inside a function) imports."""

from __future__ import annotations

import ast
import json
import sys

from tests.unit.tree.test_layers import GRAPH, MODULES, PACKAGES

#: What the image must not have (the engine's; tests/unit/tree/test_layers.py keeps the
#: operator side working without them).
ABSENT = ("vllm", "torch")
#: Imports the code guards and the image leaves out on purpose.
OPTIONAL = {"xxhash": "spillway_router.hashing: optional, as in vLLM (--hash-algo xxhash*)"}
#: As the chart runs the operator's and the router's containers.
LOCKED_DOWN = ("--network", "none", "--read-only", "--user", "1000:1000", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges")

_CHECK = """
import importlib, importlib.util, json, sys
todo = json.load(sys.stdin)
out = {"absent": {m: importlib.util.find_spec(m) is None for m in todo["absent"]},
       "failed": {}}
for m in todo["modules"]:
    if m.endswith(".__main__"):  # runs its command: its imports are in the statements
        continue
    try:
        importlib.import_module(m)
    except BaseException as e:
        out["failed"][m] = f"{type(e).__name__}: {e}"
for stmt in todo["statements"]:
    try:
        exec(stmt, {})
    except BaseException as e:
        out["failed"][stmt] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def operator_side() -> tuple[list[str], list[str]]:
    """The project modules the operator image runs (spillway_operator, spillway_router,
    spillway_cli and every project module they import, anywhere in their bodies), and
    each third-party import statement in them (``import a.b``, ``from a.b import c``)."""
    todo = [m for m in MODULES if m.split(".")[0] in
            ("spillway_operator", "spillway_router", "spillway_cli")]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += GRAPH[module]
    statements: set[str] = set()
    for module in seen:
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                statements |= {f"import {n}" for n in names if _third_party(n)}
            elif isinstance(node, ast.ImportFrom) and not node.level and _third_party(
                    node.module):
                names = [a.name for a in node.names if a.name != "*"]
                statements.add(f"from {node.module} import {', '.join(sorted(names))}")
    return sorted(seen), sorted(statements)


def _third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in PACKAGES and top not in sys.stdlib_module_names and top not in ABSENT


def test_operator_image_has_no_engine_and_imports_everything_it_runs(images):
    modules, statements = operator_side()
    # the walk sees the lazy imports too (the router's are inside functions)
    assert len(modules) >= 50, modules
    for lazy in ("import zmq", "import msgspec", "from transformers import AutoTokenizer",
                 "import cbor2", "from kubernetes import client, config, watch"):
        assert lazy in statements, f"{lazy!r} not found by the walk: {statements}"
    done = images.run("run", "--rm", "-i", *LOCKED_DOWN, "--entrypoint", "python",
                      images.operator, "-c", _CHECK, timeout=300,
                      input=json.dumps({"absent": ABSENT, "modules": modules,
                                        "statements": statements}))
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["absent"] == dict.fromkeys(ABSENT, True), result["absent"]
    failed = result["failed"]
    for stmt, why in list(failed.items()):
        words = stmt.split()
        optional = len(words) > 1 and words[1].split(".")[0] in OPTIONAL
        if optional and why.startswith("ModuleNotFoundError"):
            del failed[stmt]
    assert failed == {}, "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_operator_image_config_is_what_the_chart_expects(images):
    config = images.inspect(images.operator)["Config"]
    assert config["User"] == "1000:1000"
    assert config["Entrypoint"] == ["spillway", "operator", "run"]
    assert "HOME=/tmp" in config["Env"]
    # the image's command (the chart's args replace it) is the operator's own flags
    done = images.run("run", "--rm", *LOCKED_DOWN, "--tmpfs", "/tmp", images.operator,
                      "--help", timeout=120)
    assert "usage:" in done.stdout and "--all-namespaces" in done.stdout, done.stdout


def test_router_command_answers(images):
    """The chart's router container: `spillway-router` from the operator image, read-only,
    with no /tmp mounted (router.yaml mounts none)."""
    done = images.run("run", "--rm", *LOCKED_DOWN, "--entrypoint", "spillway-router",
                      images.operator, "--help", timeout=120)
    assert "usage: spillway-router" in done.stdout and "--kube-namespace" in done.stdout
