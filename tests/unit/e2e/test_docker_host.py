"""The real-node loaders read images from the daemon tools/images.sh built them in, with
or without SPILLWAY_RUN_DIR (a cold run beside a warm one uses its own): ``make demo``
with another run dir stopped at "docker image inspect ... Cannot connect" because the
loaders always looked in /run/spillway."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from e2e.cluster.controlplane import REPO_ROOT


def _refs_host(env: dict[str, str]) -> str:
    out = subprocess.run([str(REPO_ROOT / "tools" / "images.sh"), "--refs"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split() if "=" in line)["DOCKER_HOST"]


def _loaders_host(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", "from e2e.nodes.images import DOCKER_HOST; "
                           "print(DOCKER_HOST)"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("run_dir", [None, "/run/spillway-elsewhere"])
def test_the_loaders_docker_host_is_the_one_tools_images_sh_names(run_dir):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPILLWAY_RUN_DIR", "SPILLWAY_DOCKER_HOST")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "operator"),
                                         str(REPO_ROOT / "engine")])
    if run_dir:
        env["SPILLWAY_RUN_DIR"] = run_dir
    assert _loaders_host(env) == _refs_host(env) == \
        f"unix://{run_dir or '/run/spillway'}/docker.sock"
