"""The Dockerfile (no Docker engine here, so it is checked as text): two targets,
pinned bases, non-root final stages, entrypoints that exist, COPY sources that exist
and are not excluded by .dockerignore, and the same vLLM in the engine image as in
pyproject.toml's engine extra."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        values = [arg for o, arg in self.instructions if o == op]
        return values[-1] if values else None

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, arg = buf.partition(" ")
        out.append((op.upper(), arg.strip()))
        buf = ""
    return out


def parse() -> tuple[dict[str, str], list[Stage]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for op, arg in instructions(DOCKERFILE.read_text()):
        if op == "ARG" and not stages:
            name, _, default = arg.partition("=")
            args[name] = default
        elif op == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", arg, re.I)
            assert m, arg
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda g: args[g[1] or g[2]], m[1])
            stages.append(Stage(base, m[2]))
        else:
            assert stages, f"{op} before FROM"
            stages[-1].instructions.append((op, arg))
    return args, stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    _, parsed = parse()
    return {s.name or f"#{i}": s for i, s in enumerate(parsed)}


def test_targets(stages):
    assert {"operator", "engine"} <= set(stages)


def test_bases_are_pinned(stages):
    names = set(stages)
    for stage in stages.values():
        if stage.base in names:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and tag and "/" not in tag, f"{stage.base}: no tag"
        assert tag != "latest" and not tag.startswith("latest"), stage.base
        assert re.search(r"\d", tag), f"{stage.base}: tag without a version"


def test_operator_image(stages):
    op = stages["operator"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", op.base), op.base
    assert json.loads(op.last("ENTRYPOINT")) == ["spillway", "operator", "run"]
    run = " ".join(op.all("RUN"))
    assert "[engine" not in run and "vllm" not in run.lower()  # no engine extra


def test_engine_image_is_the_pinned_vllm(stages):
    eng = stages["engine"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    engine_extra = pyproject["project"]["optional-dependencies"]["engine"]
    (vllm_pin,) = [r for r in engine_extra if r.startswith("vllm")]
    version = vllm_pin.split("==")[1]
    assert eng.base == f"vllm/vllm-openai:v{version}"
    assert json.loads(eng.last("ENTRYPOINT")) == ["spillway-engine"]
    env = " ".join(eng.all("ENV"))
    assert "HOME=" in env and "HF_HOME=" in env


@pytest.mark.parametrize("target", ["operator", "engine"])
def test_final_stages_run_as_non_root(stages, target):
    user = stages[target].last("USER")
    assert user is not None, f"{target}: no USER"
    uid = user.split(":")[0]
    assert uid not in ("root", "0") and uid == "1000", user


def test_entrypoints_are_console_scripts(stages):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target in ("operator", "engine"):
        entry = json.loads(stages[target].last("ENTRYPOINT"))[0]
        assert entry in scripts, f"{target}: {entry} is not in [project.scripts]"
        module = scripts[entry].split(":")[0]
        path = module.replace(".", "/")
        assert any((ROOT / top / f"{path}.py").is_file() for top in ("operator", "engine")), module


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        hit = fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, f"{pat}/*") or (
            pat.startswith("**/") and fnmatch.fnmatch(path.split("/")[-1], pat[3:]))
        if hit:
            ignored = not neg
    return ignored


def dockerignore() -> list[str]:
    return [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_copy_sources_exist_and_are_not_ignored(stages):
    patterns = dockerignore()
    copies = 0
    for stage in stages.values():
        for op, arg in stage.instructions:
            if op not in ("COPY", "ADD"):
                continue
            parts = [p for p in arg.split() if not p.startswith("--")]
            if any(p.startswith("--from") for p in arg.split()):
                continue
            for src in parts[:-1]:
                copies += 1
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert not _ignored(src.rstrip("/"), patterns), f"COPY {src}: in .dockerignore"
    assert copies >= 3


def test_dockerignore_keeps_the_context_small():
    patterns = dockerignore()
    for path in (".git", ".git/config", "tests/unit/test_crd.py", "operator/x/__pycache__/a.pyc",
                 ".pytest_cache", "spillway.egg-info", "README.md"):
        assert _ignored(path, patterns), path
    for path in ("pyproject.toml", "operator/spillway_operator/main.py",
                 "operator/spillway_cli/main.py"):
        assert not _ignored(path, patterns), path


def test_engine_wheel_carries_the_vllm_plugin_entry_point():
    """The engine image installs the wheel on vLLM's image; vLLM finds Spillway's offloader
    patch through this entry point, in every worker process."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = pyproject["project"].get("entry-points", {}).get("vllm.general_plugins", {})
    assert plugins, "pyproject.toml: no [project.entry-points.\"vllm.general_plugins\"]"
    for value in plugins.values():
        module = value.split(":")[0].replace(".", "/")
        assert (ROOT / "engine" / f"{module}.py").is_file(), value


# ------------------------------------------------------------------ engine-cpu's prune

PRUNE_LIST = ROOT / "tools" / "images" / "engine-cpu-prune.txt"
LOADS = ROOT / "tools" / "images" / "engine-cpu-loads.txt"


def _prune_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prune", ROOT / "tools/images/prune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _glob_re(pattern: str) -> re.Pattern[str]:
    """A prune glob as pathlib reads it, and everything under what it names."""
    out = ""
    for part in pattern.split("/"):
        if part == "**":
            out += "(?:[^/]+/)*"
            continue
        out += "".join(".*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
                       for c in part).replace(".*", "[^/]*") + "/"
    return re.compile(out[:-1] + "(?:/.*)?")


def test_engine_cpu_prunes_in_the_layer_that_installs_vllm(stages):
    """The prune runs in the RUN that installs vLLM and torch: a later layer's removal
    would leave the bytes in the image."""
    runs = [arg for op, arg in stages["engine-cpu"].instructions if op == "RUN"]
    (install,) = [r for r in runs if re.search(r"pip install .*\bvllm torch\b", r)]
    assert "prune.py /tmp/deps/engine-cpu-prune.txt" in install, install
    copies = " ".join(stages["engine-cpu"].all("COPY"))
    assert "tools/images/engine-cpu-prune.txt" in copies and "tools/images/prune.py" in copies


def test_the_prune_list_spares_everything_the_emulated_engine_loads():
    """No glob of tools/images/engine-cpu-prune.txt names a file of site-packages that the
    emulated engine mapped, imported or opened (tools/images/engine-cpu-loads.txt, as
    measured), nor a Python file or a distribution's metadata."""
    prune = _prune_module()
    patterns = prune.globs(PRUNE_LIST.read_text())
    assert len(patterns) >= 20, patterns
    loads = [line for line in LOADS.read_text().splitlines()
             if line and not line.startswith("#")]
    assert len(loads) > 100, "the measured list looks cut short"
    for must in ("torch/lib/libtorch_cuda.so", "nvidia/cudnn/lib/libcudnn.so.9",
                 "nvidia/cu13/lib/libcublasLt.so.13", "triton/_C/libtriton.so"):
        assert must in loads, must
    for pattern in patterns:
        rx = _glob_re(pattern)
        hit = [p for p in loads if rx.fullmatch(p)]
        assert not hit, f"{pattern} would remove what the engine loads: {hit[:5]}"
        assert not pattern.endswith((".py", ".pyc")) and ".dist-info" not in pattern


def test_prune_removes_what_the_globs_name_and_refuses_what_it_must_not(tmp_path):
    prune = _prune_module()
    site = tmp_path / "site"
    for rel in ("pkg/__init__.py", "pkg/_kernels.abi3.so", "pkg/lib/libbig.so.1",
                "pkg/lib/libbig.so.2", "pkg/data/a/x.cu", "pkg/data/a/gen.py",
                "pkg-1.0.dist-info/RECORD", "other/bin/ptxas"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"x" * 10)
    removed, freed = prune.prune(site, ["pkg/*.abi3.so", "pkg/lib", "pkg/data/**/*.cu",
                                        "other/bin"])
    assert sorted(removed) == ["other/bin", "pkg/_kernels.abi3.so", "pkg/data/a/x.cu",
                               "pkg/lib"]
    assert freed == 50
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert left == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/data/a/gen.py"]
    for bad, why in (("pkg/data", "Python files"), ("nothing/*.so", "matches nothing"),
                     ("pkg-1.0.dist-info/RECORD", "metadata"), ("../x", "inside")):
        with pytest.raises(SystemExit, match=why):
            prune.prune(site, [bad])
    assert prune.globs("# c\n\na/*.so  # why\n b \n") == ["a/*.so", "b"]
