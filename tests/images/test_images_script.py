"""tools/images.sh itself: its stdout contract, a warm run that rebuilds nothing, a
broken Dockerfile that fails in one line naming the step, and the Dockerfile's layer
order (a change to Spillway's code rebuilds only the layers that install the wheel)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sysconfig
import time

import pytest

from tests.images.conftest import FIGURES, ROOT, SCRIPT, Images, refs

CONTRACT = ["DOCKER_HOST", "docker", "base", "operator", "engine", "source"]


def script(*args: str, env: dict[str, str] | None = None,
           timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def image_id(images: Images, ref: str) -> str:
    return images.inspect(ref)["Id"]


def test_refs_are_the_stdout_contract(images):
    done = script("--refs", timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("=", 1)[0] for line in lines] == CONTRACT, lines
    found = refs()
    assert found["DOCKER_HOST"].startswith("unix://") and found["docker"] == images.docker
    hashed = subprocess.run(["python3", str(ROOT / "tools/images/source_hash.py"), str(ROOT)],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert found["source"] == hashed and re.fullmatch(r"[0-9a-f]{16}", hashed)


def test_a_warm_run_rebuilds_nothing(images):
    before = {ref: image_id(images, ref) for ref in (images.base, images.operator, images.engine)}
    start = time.monotonic()
    done = script()
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == script("--refs", timeout=60).stdout
    after = {ref: image_id(images, ref) for ref in before}
    assert after == before, "a run with nothing changed made new images"
    FIGURES.append(f"tools/images.sh, warm (nothing changed): {took:.1f} s")


def test_a_broken_dockerfile_fails_in_one_line_naming_the_step(images, tmp_path):
    broken = tmp_path / "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    stage = "FROM ${PYTHON_IMAGE} AS operator\n"
    assert stage in text
    broken.write_text(text.replace(stage, stage + "COPY no-such-file /tmp/\n"))
    before = image_id(images, images.operator)
    done = script(env={"SPILLWAY_DOCKERFILE": str(broken)}, timeout=1200)
    assert done.returncode != 0
    assert done.stdout == ""  # no refs: the caller must not use the images
    last = done.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"\[tools/images\] FAILED: docker build --target operator \(log: (\S+)\)",
                     last)
    assert m, done.stderr
    assert len([line for line in done.stderr.splitlines() if "FAILED" in line]) == 1
    with open(m[1]) as log:
        assert "no-such-file" in log.read()
    assert image_id(images, images.operator) == before, "the failed build moved the tag"


def _context_copy(dest):
    """The build context's inputs, copied (no caches)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ("operator", "engine", "tools/images"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)


@pytest.mark.parametrize("target", ["operator", "engine-cpu"])
def test_a_code_change_rebuilds_only_the_wheel_layers(images, tmp_path, target):
    """One line of operator/ changed: the dependency layers (vLLM and torch's ~9 GB in
    the engine image) come from the cache, only the layers installing the wheel differ."""
    _context_copy(tmp_path)
    names = tmp_path / "operator" / "spillway_operator" / "names.py"
    # a line no earlier run wrote, so the wheel's stage really runs again
    names.write_text(names.read_text() + f"# changed by tests/images {time.time_ns()}\n")
    shipped = images.operator if target == "operator" else images.engine
    tag = f"spillway-images-test-{os.getpid()}:{target}"
    start = time.monotonic()
    done = images.run("build", "--network", "host", "--progress", "plain", "--target", target,
                      "--build-arg", f"PYTHON_IMAGE={images.base}", "-t", tag, str(tmp_path),
                      timeout=1800, check=False)
    took = time.monotonic() - start
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        old = images.inspect(shipped)["RootFS"]["Layers"]
        new = images.inspect(tag)["RootFS"]["Layers"]
    finally:
        images.run("rmi", "-f", tag, check=False)
    shared = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
                  min(len(old), len(new)))
    assert len(new) - shared <= 3 and shared >= len(old) - 3, (
        f"{len(new) - shared} of {len(new)} layers rebuilt")
    # every pip install of dependencies was a cache hit
    log = done.stderr
    steps = re.findall(r"^#(\d+) \[[^\]]*\] RUN (.*)$", log, re.M)
    deps = [n for n, cmd in steps if "--constraint" in cmd]
    assert deps, log[-3000:]
    for n in deps:
        assert re.search(rf"^#{n} CACHED$", log, re.M), f"step #{n} ran again:\n{log[-3000:]}"
    FIGURES.append(f"rebuild of {target} after a one-line change in operator/: {took:.1f} s, "
                   f"{len(new) - shared} of {len(new)} layers new")


def test_images_install_what_the_tests_ran(images):
    """Every Python package in the images is at the version of the venv the rest of the
    suite ran in (tools/images/constraints.txt is its pip freeze)."""
    # the venv's own site-packages, as pip freeze reads it: sys.path may also hold
    # setuptools' vendored packages (packaging 26.3 beside the venv's 26.4)
    site = sysconfig.get_paths()["purelib"]
    venv = {_canon(d.metadata["Name"]): d.version
            for d in importlib.metadata.distributions(path=[site])}
    for ref in (images.operator, images.engine):
        freeze = images.run("run", "--rm", "--network", "none", "--entrypoint", "python", ref,
                            "-m", "pip", "freeze", timeout=300).stdout
        pins = dict(line.split("==", 1) for line in freeze.splitlines() if "==" in line)
        assert len(pins) > 20, freeze
        differ = {name: (version, venv.get(_canon(name))) for name, version in pins.items()
                  if venv.get(_canon(name)) != version}
        assert differ == {}, f"{ref}: (image, venv) versions differ: {differ}; " \
            "regenerate the pins with tools/images.sh --constraints, then tools/images.sh"


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
