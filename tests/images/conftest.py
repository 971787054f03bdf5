"""The images tier: Spillway's own images, as tools/images.sh builds them from the
Dockerfile, run in real containers on the docker daemon that script starts.

It does not build: `make test` runs tools/images.sh first. A missing daemon or image,
or an image built from another tree than this one, fails the tier (never skips it),
with a message that names tools/images.sh.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "images.sh"
#: Every container this tier starts carries it, with the pytest process's pid.
LABEL = "dev.spillway.tests-images"
#: The label tools/images.sh puts on the images: the hash of the tree they were built from.
SOURCE_LABEL = "dev.spillway.source"
#: Figures (start-up times, sizes) printed at the end of the run.
FIGURES: list[str] = []


def refs() -> dict[str, str]:
    """tools/images.sh's stdout contract (``--refs``: starts and builds nothing)."""
    done = subprocess.run([str(SCRIPT), "--refs"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"tools/images.sh --refs: {done.stderr}"
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


@dataclass(frozen=True)
class Images:
    docker: str
    host: str
    base: str
    operator: str
    engine: str
    source: str

    def env(self) -> dict[str, str]:
        # BuildKit builds only the stages a target needs (the legacy builder would pull
        # the GPU engine's base from a registry)
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1"}

    def run(self, *args: str, timeout: float = 300, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker ARGS`` on the images' daemon, with its own (20.10) command line."""
        done = subprocess.run([self.docker, *args], capture_output=True, text=True,
                              timeout=timeout, input=input, env=self.env())
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)[:300]}: exit {done.returncode}\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def inspect(self, ref: str) -> dict[str, Any]:
        return json.loads(self.run("image", "inspect", ref).stdout)[0]

    @contextlib.contextmanager
    def container(self, name: str, args: Sequence[str]) -> Iterator[str]:
        """``docker run -d`` a container of this session (removed on the way out)."""
        full = f"spillway-images-{os.getpid()}-{name}"
        self.run("rm", "-f", full, check=False)
        self.run("run", "-d", "--name", full, "--label", f"{LABEL}={os.getpid()}", *args)
        try:
            yield full
        finally:
            self.run("rm", "-f", full, check=False, timeout=120)

    def http(self, container: str, path: str, body: dict[str, Any] | None = None,
             port: int = 8000, timeout: float = 120) -> tuple[int, str]:
        """An HTTP request from inside ``container`` (as a probe of the kubelet's would
        reach it; the containers have no network of their own): (status, body)."""
        code = (
            "import json, sys, urllib.error, urllib.request\n"
            "url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
            "req = urllib.request.Request(url, data=body.encode() or None,\n"
            "    headers={'content-type': 'application/json'})\n"
            "try:\n"
            "    r = urllib.request.urlopen(req, timeout=timeout)\n"
            "    print(json.dumps([r.status, r.read().decode(errors='replace')]))\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(json.dumps([e.code, e.read().decode(errors='replace')]))\n"
        )
        done = self.run("exec", container, "python", "-c", code,
                        f"http://127.0.0.1:{port}{path}", json.dumps(body) if body else "",
                        str(timeout), timeout=timeout + 30, check=False)
        if done.returncode != 0:
            return 0, done.stderr[-2000:]
        status, text = json.loads(done.stdout)
        return status, text

    def running(self, container: str) -> bool:
        done = self.run("inspect", "-f", "{{.State.Running}}", container, check=False)
        return done.stdout.strip() == "true"


def _fail(why: str) -> None:
    pytest.fail(f"{why}: run tools/images.sh (it starts the daemon and builds the images)",
                pytrace=False)


@pytest.fixture(scope="session")
def images() -> Images:
    found = refs()
    imgs = Images(docker=found["docker"], host=found["DOCKER_HOST"], base=found["base"],
                  operator=found["operator"], engine=found["engine"], source=found["source"])
    if not os.access(imgs.docker, os.X_OK):
        _fail(f"no docker command line at {imgs.docker}")
    up = imgs.run("version", "--format", "{{.Server.Version}}", check=False, timeout=30)
    if up.returncode != 0:
        _fail(f"no docker daemon answers on {imgs.host} ({up.stderr.strip()[-300:]})")
    for ref in (imgs.base, imgs.operator, imgs.engine):
        if imgs.run("image", "inspect", ref, check=False).returncode != 0:
            _fail(f"image {ref} is missing on {imgs.host}")
    for ref in (imgs.operator, imgs.engine):
        built = (imgs.inspect(ref)["Config"].get("Labels") or {}).get(SOURCE_LABEL)
        if built != imgs.source:
            _fail(f"image {ref} was built from another tree (source {built}, this tree "
                  f"{imgs.source})")
    _remove_leftovers(imgs)
    return imgs


def _remove_leftovers(imgs: Images) -> None:
    """Containers of an earlier pytest run of this tier that was killed."""
    listed = imgs.run("ps", "-a", "--filter", f"label={LABEL}", "--format",
                      f'{{{{.ID}}}} {{{{.Label "{LABEL}"}}}}').stdout.split("\n")
    for line in filter(None, listed):
        cid, _, pid = line.partition(" ")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            imgs.run("rm", "-f", cid, check=False)


def wait_until(what: str, check, timeout: float, interval: float = 1.0) -> float:
    """Seconds until ``check()`` is true; AssertionError naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("spillway images")
        for line in FIGURES:
            terminalreporter.write_line(line)
