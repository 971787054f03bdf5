"""A pod's engine killed with SIGKILL, restarted in the same shm volume and size limit.

The pod's ``/dev/shm`` is a memory-backed emptyDir sized by the plan: it outlives the
container, so whatever a killed engine left there still counts against the limit. Here
a tmpfs of exactly the plan's ``pod.shm_bytes`` stands for that volume, and each engine
runs in its own mount namespace with the tmpfs bind-mounted on ``/dev/shm`` (vLLM's
region path is fixed to /dev/shm), as a container does. The host pool is put in vLLM's
real ``SharedOffloadRegion`` (``SPILLWAY_SHARED_REGION=1``), as on a CUDA GPU.

What the kill leaves is asserted, not assumed: with Spillway's all-workers barrier the
region's file is unlinked once mapped, so a SIGKILL while serving frees it. What does
stay is made by vLLM's own code in a process that is then SIGKILLed: a region made
without the barrier (upstream's tiering spec, vLLM #54002), and a ``MessageQueue`` ring.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.engine_process import (
    ENGINE,
    EXIT_TIMEOUT_S,
    Server,
    free_port,
    kill_group,
    launch,
    plan_for,
    post,
    sigkill_group,
    wait_ready,
    write_plan,
)
from spillway_engine.emulator.tiny import llama_config, write_model
from spillway_engine.launcher.preflight import check_shm
from spillway_engine.planner.plan import Plan

KV_BYTES = 80 * 4096  # the emulated GPU's KV budget (as test_emulated_engine's llama)


def _namespace(volume: Path) -> list[str]:
    """Run the rest in a private mount namespace with ``volume`` on /dev/shm."""
    script = 'mount --bind "$0" /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(volume)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("restart") / "llama", llama_config(num_layers=2))


@pytest.fixture(scope="module")
def plan(model_dir: Path) -> Plan:
    return plan_for(model_dir)


@pytest.fixture
def volume(tmp_path: Path, plan: Plan) -> Iterator[Path]:
    """A tmpfs with the plan's shm size limit: the pod's emptyDir (medium Memory)."""
    path = tmp_path / "pod-shm"
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={plan.pod.shm_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"needs to mount a tmpfs (root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        probe = subprocess.run([*_namespace(path), "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"needs a private mount namespace (unshare): {probe.stderr.strip()}")
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def _used(volume: Path) -> int:
    st = os.statvfs(volume)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _free(volume: Path) -> int:
    st = os.statvfs(volume)
    return st.f_bavail * st.f_frsize


def _files(volume: Path) -> dict[str, int]:
    """name -> bytes the file holds in the tmpfs."""
    return {p.name: p.stat().st_blocks * 512 for p in sorted(volume.iterdir())}


def _start(plan: Plan, model_dir: Path, volume: Path, root: Path) -> Server:
    plan_path = write_plan(root, plan, model_dir)
    port = free_port()
    env = {"SPILLWAY_SHM_DIR": "/dev/shm", "SPILLWAY_SHARED_REGION": "1"}
    log = root / "engine.log"
    proc = launch(plan_path, log, port, KV_BYTES, env=env, prefix=_namespace(volume))
    return Server("llama", proc, port, log, plan, 0.0)


def _complete(server: Server, n: int, seed: int) -> dict:
    tokens = [(seed * 7919 + i * 104729) % 497 + 3 for i in range(n)]
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    return post(server.url("/v1/completions"), body)


_LEFTOVERS = r"""
import sys, threading
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
rows, row, slot = (int(a) for a in sys.argv[1:4])
# as upstream's tiering spec makes it (no barrier: the file stays linked), written
region = SharedOffloadRegion(engine_id="killed-engine", num_chunks=rows, rank=0,
                             kv_bytes_per_chunk=row, cpu_page_size=slot, barrier=None)
ring = MessageQueue(n_reader=1, n_local_reader=1)  # the mp executor's broadcast ring
print(region.mmap_path, ring.buffer.shared_memory.name, flush=True)
threading.Event().wait()
"""


def _leave_what_a_killed_engine_leaves(plan: Plan, volume: Path) -> list[str]:
    """vLLM's own region and ring, made in a process that is then SIGKILLed."""
    page = 4096
    unit = plan.spillway.unit_bytes
    row = -(-unit * plan.spillway.copies // page) * page
    args = [str(plan.spillway.num_units), str(row), str(unit)]
    proc = subprocess.Popen(
        [*_namespace(volume), sys.executable, "-c", _LEFTOVERS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert len(line) == 2, "the leftover maker did not start"
    finally:
        sigkill_group(proc)
    return [Path(line[0]).name, line[1]]


def test_sigkilled_engine_restarts_in_the_same_shm_limit(
    plan: Plan, model_dir: Path, volume: Path, tmp_path: Path
):
    region = plan.pod.pool_bytes_per_engine
    first = _start(plan, model_dir, volume, tmp_path / "first")
    try:
        wait_ready(first)
        for seed in range(4):  # fill some of the pool
            _complete(first, 600, seed)
        # the pool is in the pod's shm (charged to its limit), its file already unlinked
        assert _used(volume) >= region
        assert not [n for n in _files(volume) if n.startswith("vllm_offload_")]
    finally:
        sigkill_group(first.proc)
    after_kill = _files(volume)
    print(f"\n[restart] left by SIGKILL while serving: {after_kill}; used {_used(volume)} B")
    assert not [n for n in after_kill if n.startswith("vllm_offload_")]
    assert _used(volume) < region  # the kernel freed the unlinked region

    region_file, ring = _leave_what_a_killed_engine_leaves(plan, volume)
    left = _files(volume)
    print(f"[restart] left by a killed tiering-style engine: {left}")
    assert left[region_file] >= plan.spillway.num_units * plan.spillway.unit_bytes
    assert ring in left
    # without freeing them the restarted engine would not fit the same limit
    assert check_shm(plan, volume, _free(volume), plan.pod.shm_bytes) is not None

    second = _start(plan, model_dir, volume, tmp_path / "second")
    try:
        wait_ready(second)
        assert _complete(second, 600, 9)["usage"]["completion_tokens"] == 2
        log = second.log_text()
        assert f"freed leftover /dev/shm/{region_file}: {left[region_file]} bytes" in log
        assert f"freed leftover /dev/shm/{ring}: {left[ring]} bytes" in log
        assert "preflight ok" in log
        assert region_file not in _files(volume) and ring not in _files(volume)
        assert _used(volume) >= region  # the new engine's own pool
    finally:
        kill_group(second.proc)


def test_preflight_shortfall_stops_serve_before_vllm(plan: Plan, model_dir: Path, tmp_path: Path):
    """The pod's entry point with a container limit below the plan: exit 3, one line
    on stderr and in the termination message, and vLLM never started."""
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    limit = plan.pod.memory_request_bytes // 2
    (cgroup / "memory.max").write_text(f"{limit}\n")
    plan_path = write_plan(tmp_path / "p", plan, model_dir)
    (tmp_path / "shm").mkdir()
    env = dict(os.environ)
    env.update(
        SPILLWAY_SHM_DIR=str(tmp_path / "shm"),
        SPILLWAY_CGROUP_ROOT=str(cgroup),
        SPILLWAY_TERMINATION_LOG=str(tmp_path / "termination-log"),
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [*ENGINE, "serve", "--plan", str(plan_path), "--emulate-gpu",
         "--kv-events-port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
    )
    print(f"\n[preflight] refused in {time.monotonic() - t0:.1f} s: {done.stderr.strip()}")
    assert done.returncode == 3
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("spillway-engine: error: preflight: memory: container memory limit")
    assert f"{limit} bytes" in line and str(cgroup / "memory.max") in line
    assert "exec vllm" not in done.stderr
    assert (tmp_path / "termination-log").read_text() == line
