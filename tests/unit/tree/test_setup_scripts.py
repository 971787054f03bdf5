"""The first run's scripts, their logic without the network: tools/build.sh against a
stand-in ``go`` (chains built at once, one ``go build`` per family, the flags, the order
of its stdout lines, a warm run that builds nothing, a failure), tools/venv.sh against a
stand-in python and pip (the extras a venv holds and when it installs again), and the
Makefile's demo and test prerequisites (installed at once, the demo's venv without vLLM).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ORDER = ["k8s", "node", "etcd", "kwok", "helm", "imageref", "gpuplugin", "coredns", "gie",
         "lws"]

# ------------------------------------------------------------------ tools/build.sh

FAKE_GO = r'''#!PYTHON
"""A stand-in for go: `go build` writes a file per binary and logs the call; the module
queries tools/build.sh makes print folders shaped like the real modules'."""
import json, os, sys, time
from pathlib import Path

log = Path(os.environ["FAKE_GO_LOG"])
mods = Path(os.environ["FAKE_GO_MODS"])
args = sys.argv[1:]
if args[0] == "build":
    out = args[args.index("-o") + 1]
    pkgs = [a for a in args[args.index("-o") + 2:]]
    fail = os.environ.get("FAKE_GO_FAIL", "")
    start = time.time()
    time.sleep(float(os.environ.get("FAKE_GO_SLEEP", "0.3")))
    if fail and any(fail in p for p in pkgs):
        sys.exit(f"fake go: build of {pkgs} failed")
    targets = [Path(out) / Path(p).name for p in pkgs] if out.endswith("/") else [Path(out)]
    for t in targets:
        t.write_text("#!/bin/sh\n")
        t.chmod(0o755)
    with log.open("a") as f:
        f.write(json.dumps({"cwd": os.getcwd(), "args": args, "out": out, "pkgs": pkgs,
                            "goflags": os.environ.get("GOFLAGS", ""),
                            "cgo": os.environ.get("CGO_ENABLED", ""),
                            "start": start, "end": time.time()}) + "\n")
elif args[:2] == ["mod", "download"]:
    if "-json" in args:
        print("{\n\t\"Path\": \"x\",\n\t\"Dir\": \"%s\",\n\t\"Sum\": \"h1:x\"\n}" % (mods / "gie"))
elif args[:2] == ["list", "-m"]:
    print(mods / args[-1].split("/")[-1])
else:
    sys.exit(f"fake go: {args}")
'''


def _modules(root: Path) -> None:
    """What the real module downloads hold that tools/build.sh copies or patches."""
    kwok = root / "kwok" / "pkg" / "kwok" / "controllers"
    kwok.mkdir(parents=True)
    (kwok / "utils.go").write_text("func shouldRetry(err error) bool {\n"
                                   "\tif apierrors.IsServerTimeout(err) ||\n\t\treturn true\n}\n")
    gie = root / "gateway-api-inference-extension" / "config" / "crd" / "bases"
    gie.mkdir(parents=True)
    (gie / "inference.networking.k8s.io_inferencepools.yaml").write_text("kind: CRD\n")
    lws = root / "lws" / "config"
    (lws / "crd" / "bases").mkdir(parents=True)
    (lws / "crd" / "bases" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml").write_text("x\n")
    (lws / "webhook").mkdir()
    for name in ("manifests", "mutating-patch", "validating-patch"):
        (lws / "webhook" / f"{name}.yaml").write_text("x\n")


@pytest.fixture
def fake_go(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(FAKE_GO.replace("PYTHON", sys.executable, 1))
    go.chmod(0o755)
    _modules(tmp_path / "mods")
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_GO_LOG": str(tmp_path / "go.log"), "FAKE_GO_MODS": str(tmp_path / "mods"),
            "SPILLWAY_BIN_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}


def build(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "tools" / "build.sh")], capture_output=True, text=True,
                          timeout=120, env={**env, **extra})


def calls(env: dict[str, str]) -> list[dict]:
    log = Path(env["FAKE_GO_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_build_prints_every_family_in_order_and_builds_each_once(fake_go):
    done = build(fake_go)
    assert done.returncode == 0, done.stderr
    cache = Path(fake_go["SPILLWAY_BIN_CACHE"])
    lines = done.stdout.splitlines()
    assert [line.split("=", 1)[0] for line in lines] == ORDER, lines
    dirs = dict(line.split("=", 1) for line in lines)
    for fam, binaries in {"k8s": ["kube-apiserver", "kube-controller-manager",
                                  "kube-scheduler", "kubectl"],
                          "node": ["kubelet", "kube-proxy"], "etcd": ["etcd"],
                          "kwok": ["kwok"], "helm": ["helm"], "imageref": ["imageref"],
                          "gpuplugin": ["gpuplugin"], "coredns": ["coredns"], "gie": ["epp"],
                          "lws": ["lws-controller"]}.items():
        assert Path(dirs[fam]).parent == cache, dirs[fam]
        for b in binaries:
            assert os.access(Path(dirs[fam]) / b, os.X_OK), (fam, b)
    crd = Path(dirs["gie"]) / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
    assert crd.is_file()
    assert (Path(dirs["lws"]) / "webhook" / "validating-patch.yaml").is_file()
    # one go build per family: Kubernetes' commands together, linked in parallel by go
    builds = calls(fake_go)
    assert len(builds) == 10, [b["pkgs"] for b in builds]
    (k8s,) = [b for b in builds if "k8s.io/kubernetes/cmd/kubectl" in b["pkgs"]]
    assert k8s["out"].endswith("/") and len(k8s["pkgs"]) == 4
    (node,) = [b for b in builds if "k8s.io/kubernetes/cmd/kubelet" in b["pkgs"]]
    assert node["cwd"].endswith("tools/node") and len(node["pkgs"]) == 2
    for b in builds:
        assert b["cgo"] == "0"
        assert set(b["goflags"].split()) == {"-trimpath", "-gcflags=all=-dwarf=false"}
        assert "-s -w" in b["args"][b["args"].index("-ldflags") + 1]
    # the kwok module patched (500s retried) and built through the replacing go.mod
    (kwok,) = [b for b in builds if b["pkgs"] == ["sigs.k8s.io/kwok/cmd/kwok"]]
    assert any(a.startswith("-modfile=") for a in kwok["args"])
    # GIE's endpoint picker from tools/gie, which pins the version versions.env names
    (gie,) = [b for b in builds if b["pkgs"] == [GIE_EPP]]
    assert gie["cwd"].endswith("tools/gie")
    # CoreDNS from tools/coredns: only the plugins its Corefile uses are linked in
    (coredns,) = [b for b in builds if b["cwd"].endswith("tools/coredns")]
    assert coredns["pkgs"] == ["."]


GIE_EPP = "sigs.k8s.io/gateway-api-inference-extension/cmd/epp"


def test_tools_gie_pins_the_gie_version_of_versions_env():
    versions = dict(line.split("=", 1) for line in
                    (ROOT / "tools" / "versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    gomod = (ROOT / "tools" / "gie" / "go.mod").read_text()
    assert f"\tsigs.k8s.io/gateway-api-inference-extension v{versions['GIE_VERSION']} " in gomod
    assert f"tool {GIE_EPP}\n" in gomod


def test_build_runs_the_kubernetes_chain_beside_the_others(fake_go):
    done = build(fake_go, FAKE_GO_SLEEP="1")
    assert done.returncode == 0, done.stderr
    builds = calls(fake_go)
    (k8s,) = [b for b in builds if "k8s.io/kubernetes/cmd/kubectl" in b["pkgs"]]
    (etcd,) = [b for b in builds if b["pkgs"] == ["go.etcd.io/etcd/server/v3"]]
    assert k8s["start"] < etcd["end"] and etcd["start"] < k8s["end"], "not built at once"
    # the node's commands after the control plane's (they reuse its compiled packages)
    (node,) = [b for b in builds if "k8s.io/kubernetes/cmd/kubelet" in b["pkgs"]]
    assert node["start"] >= k8s["end"]


def test_build_with_one_job_builds_one_family_at_a_time(fake_go):
    done = build(fake_go, SPILLWAY_BUILD_JOBS="1")
    assert done.returncode == 0, done.stderr
    spans = sorted((b["start"], b["end"]) for b in calls(fake_go))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert [line.split("=", 1)[0] for line in done.stdout.splitlines()] == ORDER


def test_a_warm_build_builds_nothing(fake_go):
    first = build(fake_go)
    assert first.returncode == 0, first.stderr
    Path(fake_go["FAKE_GO_LOG"]).unlink()
    again = build(fake_go)
    assert again.returncode == 0, again.stderr
    assert calls(fake_go) == [] and again.stdout == first.stdout


def test_a_failed_build_prints_no_folders_and_keeps_no_half_family(fake_go):
    done = build(fake_go, FAKE_GO_FAIL="helm.sh/helm")
    assert done.returncode != 0
    assert done.stdout == ""
    assert "a build failed" in done.stderr.splitlines()[-1]
    cache = Path(fake_go["SPILLWAY_BIN_CACHE"])
    assert not list(cache.glob("helm-v*")), "a failed family left a folder"


# ------------------------------------------------------------------ tools/venv.sh

FAKE_PYTHON = r'''#!PYTHON
"""A stand-in python: passes the version check, makes a venv of stand-ins."""
import os, shutil, sys
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.exit(0)
if args[:2] == ["-m", "venv"]:
    venv = Path(args[2])
    (venv / "bin").mkdir(parents=True)
    shutil.copy(__file__, venv / "bin" / "python")
    pip = venv / "bin" / "pip"
    pip.write_text("#!/bin/sh\necho \"$*\" >> \"$FAKE_PIP_LOG\"\n")
    pip.chmod(0o755)
    sys.exit(0)
sys.exit(f"fake python: {args}")
'''


@pytest.fixture
def fake_venv(tmp_path: Path) -> dict[str, str]:
    """A copy of the repository's venv.sh in a tree of its own (its pyproject.toml and
    pins can change), and a stand-in python."""
    tree = tmp_path / "tree"
    (tree / "tools" / "images").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "venv.sh", tree / "tools" / "venv.sh")
    (tree / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tree / "tools" / "images" / "constraints.txt").write_text("a==1\n")
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON.replace("PYTHON", sys.executable, 1))
    py.chmod(0o755)
    return {**os.environ, "PYTHON": str(py), "SPILLWAY_VENV": str(tmp_path / "venv"),
            "FAKE_PIP_LOG": str(tmp_path / "pip.log"), "TREE": str(tree)}


def venv(env: dict[str, str], extras: str) -> list[str]:
    """Run venv.sh with EXTRAS; the pip installs it ran (the extras each installed)."""
    log = Path(env["FAKE_PIP_LOG"])
    before = log.read_text().splitlines() if log.exists() else []
    done = subprocess.run([str(Path(env["TREE"]) / "tools" / "venv.sh")], capture_output=True,
                          text=True, timeout=60, env={**env, "EXTRAS": extras})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{env['SPILLWAY_VENV']}/bin/python"
    new = (log.read_text().splitlines() if log.exists() else [])[len(before):]
    return [line.rsplit("[", 1)[1].rstrip("]") for line in new if " -e " in line]


def test_venv_installs_the_extras_asked_for_and_keeps_those_it_has(fake_venv):
    assert venv(fake_venv, "test") == ["test"]  # make demo: no vLLM
    assert venv(fake_venv, "test") == []
    assert venv(fake_venv, "test,engine") == ["engine,test"]  # make test adds vLLM
    assert venv(fake_venv, "test") == []  # make demo again: a superset is there
    assert venv(fake_venv, "engine,test") == []
    assert venv(fake_venv, "router") == ["engine,router,test"]  # none lost


def test_venv_installs_again_when_the_project_or_the_pins_change(fake_venv):
    tree = Path(fake_venv["TREE"])
    assert venv(fake_venv, "test,engine") == ["engine,test"]
    (tree / "tools" / "images" / "constraints.txt").write_text("a==2\n")
    assert venv(fake_venv, "test") == ["test"]  # new pins: what is asked for, again
    (tree / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert venv(fake_venv, "test") == ["test"]


def test_venv_made_by_the_old_stamp_format_is_reused(fake_venv):
    """A venv stamped before extras were kept in order ("test,engine") is up to date."""
    assert venv(fake_venv, "test,engine") == ["engine,test"]
    stamp = Path(fake_venv["SPILLWAY_VENV"]) / ".spillway-stamp"
    key, _, root = stamp.read_text().split()
    stamp.write_text(f"{key} test,engine {root}\n")
    assert venv(fake_venv, "test,engine") == []


# ------------------------------------------------------------------ Makefile


def make_n(target: str) -> list[str]:
    done = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), target],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MAKEFLAGS": ""})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_demo_installs_at_once_and_its_venv_has_no_vllm():
    lines = make_n("demo")
    assert any("-j3" in line and "venv-demo" in line and "tools-demo" in line
               and "images-in-nodes" in line for line in lines), lines
    # only the families the demo runs: not GIE's picker, not the test-only binaries
    [build] = [line for line in lines if line.startswith("tools/build.sh ")]
    families = [w for w in build.split()[1:] if w[0] != ">"]
    assert families == ["k8s", "node", "gpuplugin", "etcd", "kwok", "helm", "lws", "coredns"]
    # the images go into the nodes' roots once built, not after the Go builds
    assert any(line.endswith("-m e2e.nodes preload") for line in lines), lines
    assert "EXTRAS=test tools/venv.sh >/dev/null" in lines, lines
    assert not any("EXTRAS=test,engine" in line for line in lines), lines
    assert lines[-1].rstrip().endswith("-m e2e.demo --real-nodes"), lines


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_test_installs_at_once_with_vllm():
    lines = make_n("test")
    assert any("-j3" in line and " venv " in f"{line} " and "images" in line
               for line in lines), lines
    assert "EXTRAS=test,engine tools/venv.sh >/dev/null" in lines, lines


def test_scripts_pass_shellcheck():
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if not found:
        pytest.fail("shellcheck is missing: install the test extra (pip install -e '.[test]')")
    scripts = [ROOT / "tools" / name for name in ("build.sh", "venv.sh", "images.sh",
                                                  "host.sh")]
    done = subprocess.run([found, *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, textwrap.shorten(done.stdout, 3000)


def test_named_families_keep_the_two_chains(fake_go):
    """The demo's families: only those are built, Kubernetes' chain beside the rest."""
    done = build(fake_go, FAKE_GO_SLEEP="1")  # warm the fake module cache first
    fresh = {**fake_go, "SPILLWAY_BIN_CACHE": fake_go["SPILLWAY_BIN_CACHE"] + "-demo"}
    Path(fake_go["FAKE_GO_LOG"]).unlink()
    done = subprocess.run([str(ROOT / "tools" / "build.sh"), "k8s", "etcd", "coredns"],
                          capture_output=True, text=True, timeout=120,
                          env={**fresh, "FAKE_GO_SLEEP": "1"})
    assert done.returncode == 0, done.stderr
    assert [line.split("=", 1)[0] for line in done.stdout.splitlines()] == [
        "k8s", "etcd", "coredns"]
    builds = calls(fake_go)
    assert len(builds) == 3, [b["pkgs"] for b in builds]
    (k8s,) = [b for b in builds if "k8s.io/kubernetes/cmd/kubectl" in b["pkgs"]]
    (etcd,) = [b for b in builds if b["pkgs"] == ["go.etcd.io/etcd/server/v3"]]
    assert k8s["start"] < etcd["end"] and etcd["start"] < k8s["end"], "not built at once"


def test_build_of_named_families_only(fake_go):
    """`tools/build.sh kvindexer`: llm-d's indexer harness, built only when named (the
    interop contract test names it); an unknown family is refused."""
    done = subprocess.run([str(ROOT / "tools" / "build.sh"), "kvindexer"], capture_output=True,
                          text=True, timeout=120, env=fake_go)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    name, folder = line.split("=", 1)
    assert name == "kvindexer" and os.access(Path(folder) / "kvindexer", os.X_OK)
    [b] = calls(fake_go)
    assert b["cwd"].endswith("tools/kvindexer") and b["cgo"] == "0"
    done = subprocess.run([str(ROOT / "tools" / "build.sh"), "bogus"], capture_output=True,
                          text=True, timeout=120, env=fake_go)
    assert done.returncode == 2 and "unknown family bogus" in done.stderr
