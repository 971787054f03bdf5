"""The house's floors, checked: every import in the tree -- the packages under
``engine/`` and ``operator/``, and ``e2e/``, ``bench/`` and ``tests/`` -- at module level
or inside a function (a lazy import is a dependency all the same) goes to its own floor
or one below, and no set of modules imports itself round in a circle. An import under
``if TYPE_CHECKING:`` never runs and only names a type for the reader (the real nodes
name the ``LocalCluster`` that drives them); it is left out.

Engine: base -> planner -> seam -> offloader -> launcher, the flow; the stand-ins for
the GPU (emulator, simulator) beside it, importing the flow, never imported by it; the
``spillway-engine`` command on top, wiring both. Operator: names -> plumbing (the API
server) -> flow (the steps and their loops) -> the process (kopf wiring, work queue).
Across the seam the operator and the router import the engine's floors up to the seam
only (the operator image has no vLLM); ``spillway`` (the user's command) may use all.
The rest of the tree stands on top of the packages and may import any of them:
e2e base -> real nodes -> control plane -> e2e harness (install, operator process,
simulator fleet, gateway, kind) -> demo -> contract harness (vLLM built on the CPU) ->
bench -> device checks (``e2e/gpu``) -> tests. No package imports any of it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {"spillway_engine": "engine", "spillway_operator": "operator",
            "spillway_router": "operator", "spillway_cli": "operator"}

# (floor, modules or packages on it), lowest first, per side of the seam.
ENGINE_FLOORS = [
    ("engine base", ["spillway_engine", "spillway_engine.arith", "spillway_engine.quantity",
                     "spillway_engine.vllm_pins", "spillway_engine.vllm_cli",
                     "spillway_engine.word_tokenizer"]),
    ("planner", ["spillway_engine.planner"]),
    ("seam", ["spillway_engine.seam", "spillway_engine.metrics"]),
    ("offloader", ["spillway_engine.offloader"]),
    ("launcher", ["spillway_engine.launcher"]),
    ("stand-ins", ["spillway_engine.emulator", "spillway_engine.simulator"]),
    ("engine command", ["spillway_engine.cli"]),
]
OPERATOR_FLOORS = [
    ("operator names", ["spillway_operator", "spillway_operator.names"]),
    ("plumbing", ["spillway_operator.plumbing"]),
    ("flow", ["spillway_operator.flow"]),
    ("process", ["spillway_operator.controller", "spillway_operator.handlers",
                 "spillway_operator.main", "spillway_operator.__main__"]),
]
ROUTER_FLOORS = [("router", ["spillway_router"])]
#: The rest of the tree (named from the repository root), lowest first.
TREE_FLOORS = [
    ("e2e base", ["e2e", "e2e.processes", "e2e.engine_process", "e2e.cluster.errors",
                  "e2e.cluster.gfd",
                  "e2e.cluster.pki", "e2e.nodes.ociimage"]),
    ("real nodes", ["e2e.nodes"]),
    ("control plane", ["e2e.cluster"]),
    ("e2e harness", ["e2e.install", "e2e.operator_process", "e2e.simfleet", "e2e.gateway",
                     "e2e.kind"]),
    ("demo", ["e2e.demo"]),
    ("contract harness", ["tests.helpers", "tests.contract.conftest",
                          "tests.contract.vllm_harness", "tests.contract.offload_loop",
                          "tests.contract.cuda_selector"]),
    ("bench", ["bench"]),
    ("device checks", ["e2e.gpu"]),
    ("tests", ["tests"]),
]
TREE = ("e2e", "bench", "tests")
#: How high into the engine each operator-side package may reach.
ENGINE_REACH = {"spillway_operator": "seam", "spillway_router": "seam",
                "spillway_cli": "engine command"}


def modules() -> dict[str, Path]:
    found = {}
    roots = [(ROOT / base / package, ROOT / base) for package, base in PACKAGES.items()]
    roots += [(ROOT / top, ROOT) for top in TREE]
    for where, base in roots:
        for path in where.rglob("*.py"):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import statements under ``if TYPE_CHECKING:`` (never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(module: str) -> set[str]:
    """The project modules ``module`` imports, anywhere in its body (type-only ones
    left out)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # "from pkg import name" imports the submodule when there is one, else pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != module:
                out.add(resolved)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def floor_of(module: str) -> tuple[str, int, str]:
    """(side, floor index, floor name) of a module: the longest listed prefix wins."""
    best: tuple[int, str, int, str] | None = None
    for side, floors in (("engine", ENGINE_FLOORS), ("operator", OPERATOR_FLOORS),
                         ("router", ROUTER_FLOORS), ("cli", [("spillway", ["spillway_cli"])]),
                         ("tree", TREE_FLOORS)):
        for index, (name, prefixes) in enumerate(floors):
            for prefix in prefixes:
                on = module == prefix or module.startswith(prefix + ".")
                if on and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), side, index, name)
    assert best is not None, f"{module} is on no floor: add it to tests/unit/tree/test_layers.py"
    return best[1], best[2], best[3]


def engine_index(name: str) -> int:
    return [n for n, _ in ENGINE_FLOORS].index(name)


def upward(src: str, dst: str) -> str | None:
    side, index, name = floor_of(src)
    dside, dindex, dname = floor_of(dst)
    if side == dside:
        return None if dindex <= index else f"{name} -> {dname}"
    if side == "tree":
        return None  # e2e, bench and tests stand on every package
    if dside == "tree":
        return f"{name} ({side}) -> {dname}: a package imports the harness or the tests"
    if dside == "engine" and side != "engine":
        reach = engine_index(ENGINE_REACH[src.split(".")[0]])
        return None if dindex <= reach else f"{name} reaches the engine's {dname}"
    if side == "cli":
        return None
    return f"{name} ({side}) -> {dname} ({dside})"


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_import_goes_up_a_floor():
    bad = sorted(f"{src} -> {dst}: {why}" for src, dsts in GRAPH.items() for dst in dsts
                 if (why := upward(src, dst)))
    assert bad == [], "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def test_the_checks_can_fail():
    """The checkers on a made-up tree: a circle and an upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward("spillway_engine.offloader.spec", "spillway_engine.emulator.platform")
    assert upward("spillway_operator.flow.spec", "spillway_engine.launcher.serve")
    assert upward("spillway_operator.plumbing.kube", "spillway_operator.flow.render")
    assert upward("spillway_engine.planner.plan", "spillway_operator.flow.spec")
    assert not upward("spillway_engine.emulator.platform", "spillway_engine.launcher.plugin")
    assert not upward("spillway_cli.main", "spillway_engine.simulator.core")
    assert upward("e2e.nodes.realnodes", "e2e.cluster.controlplane")
    assert upward("bench.disk_tier", "tests.contract.test_emulated_engine")
    assert upward("spillway_engine.simulator.core", "bench.simulator")
    assert not upward("tests.unit.bench.test_bench_disk_tier", "bench.disk_tier")
    assert not upward("bench.pod_memory", "e2e.engine_process")
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    import a\nimport b\n")
    assert len(_type_only(tree)) == 2  # the statement and its alias, not ``import b``


def test_the_tree_is_covered():
    """The walk reaches past the packages: e2e, bench and tests are in the graph."""
    assert {m.split(".")[0] for m in MODULES} >= set(TREE)
    assert "e2e.cluster.controlplane" in GRAPH["e2e.nodes"] | GRAPH["e2e.install"]


def test_the_operator_side_runs_without_vllm():
    """What the operator image runs (it has no vLLM, no torch) imports and works with
    both made unimportable: the operator's process, the router, the spec's extraArgs
    check against vLLM's committed argument table, the router reading engine.json."""
    code = """
import sys
sys.modules["vllm"] = None
sys.modules["torch"] = None
import spillway_operator.handlers, spillway_operator.main, spillway_router.main
from spillway_operator.flow.spec import InferenceDeploymentSpec
spec = InferenceDeploymentSpec.model_validate({"model": {"name": "org/m"},
    "engine": {"extraArgs": ["--max-num-seqs", "8"]}, "offload": {"hostMemory": "1Gi"}})
try:
    InferenceDeploymentSpec.model_validate({"model": {"name": "org/m"},
        "engine": {"extraArgs": ["--max-num-seqz", "8"]}, "offload": {"hostMemory": "1Gi"}})
except ValueError as e:
    assert "unrecognized arguments" in str(e), e
else:
    raise AssertionError("an unknown flag was accepted")
from spillway_engine.seam import parse_engine_options
assert parse_engine_options({"model": "m"}, "engine.json").model == "m"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
