"""Preflight (can the container hold the plan?) and the shm folder's leftover cleanup.

Real files in tmp folders stand for the pod's host: a memory cgroup's ``memory.max``
(v2) or ``memory.limit_in_bytes`` (v1), the shm folder, the termination log.
"""

from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spillway_engine import cli
from spillway_engine.launcher import preflight, serve
from spillway_engine.launcher.preflight import (
    Facts,
    check_memlock,
    check_memory,
    check_shm,
    memory_limit,
    pinned_bytes_per_worker,
    shortfalls,
)
from spillway_engine.launcher.shm_cleanup import free_leftovers, is_leftover_name, shm_dir
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan
from tests.unit.planner_fixtures import load_model

GIB = 2**30
MIB = 2**20


def plan_for(model: str = "llama-3.2-1b", **kw: Any) -> Plan:
    kw.setdefault("cpu_memory_bytes", 8 * GIB)
    kw.setdefault("max_model_len", 8192)
    return make_plan(load_model(model), PlanRequest(model_name=model, **kw))


PLAN = plan_for()
PLENTY = Facts(
    shm_free=64 * GIB,
    shm_total=64 * GIB,
    memory_limit=None,
    memory_source="test",
    memlock_soft=resource.RLIM_INFINITY,
    ipc_lock=False,
)


# ------------------------------------------------------------------- each check


def test_shm_shortfall_names_the_numbers_and_the_field():
    need = PLAN.pod.shm_bytes
    assert check_shm(PLAN, Path("/dev/shm"), need, need) is None
    short = check_shm(PLAN, Path("/dev/shm"), need - 1, 64 * MIB)
    assert short is not None and short.check == "shm"
    assert "\n" not in short.line
    assert f"{need - 1} bytes free" in short.line
    assert f"needs {need} bytes" in short.line
    assert "sizeLimit" in short.line and "offload.hostMemory" in short.line


def test_shm_need_counts_every_data_parallel_engine():
    dp2 = plan_for(data_parallel_size=2)
    regions = 2 * dp2.pod.pool_bytes_per_engine
    assert dp2.pod.shm_bytes >= regions
    # room for one engine's region and the queues, not two regions
    assert check_shm(dp2, Path("/dev/shm"), PLAN.pod.shm_bytes, 64 * GIB) is not None
    short = check_shm(dp2, Path("/dev/shm"), 0, 64 * GIB)
    assert short is not None and "x 2 engines" in short.line


def test_memory_shortfall_names_the_numbers_and_the_field():
    need = PLAN.pod.memory_request_bytes
    assert check_memory(PLAN, None, "memory.max") is None  # no limit
    assert check_memory(PLAN, need, "memory.max") is None
    short = check_memory(PLAN, need - MIB, "/sys/fs/cgroup/memory.max")
    assert short is not None and short.check == "memory"
    assert f"limit {need - MIB} bytes" in short.line and f"plan's {need} bytes" in short.line
    assert f"resources.limits.memory >= {PLAN.pod.memory_limit_bytes}" in short.line
    assert "\n" not in short.line


def test_memlock_shortfall_only_where_the_region_is_pinned():
    need = pinned_bytes_per_worker(PLAN)
    assert need == PLAN.pod.pool_bytes_per_engine  # one worker, one copy
    low = 8 * MIB
    assert check_memlock(PLAN, False, low, False) is None  # emulated GPU: nothing pinned
    assert check_memlock(PLAN, True, low, True) is None  # CAP_IPC_LOCK lifts the limit
    assert check_memlock(PLAN, True, resource.RLIM_INFINITY, False) is None
    assert check_memlock(PLAN, True, need, False) is None
    short = check_memlock(PLAN, True, low, False)
    assert short is not None and short.check == "memlock"
    assert not short.fatal  # vLLM falls back to pageable copies: a warning
    assert f"is {low} bytes" in short.line and f"pins {need} bytes" in short.line
    assert "LimitMEMLOCK" in short.line and "IPC_LOCK" in short.line


def test_memlock_need_is_one_workers_share_under_tensor_parallelism():
    tp2 = plan_for(tensor_parallel_size=2)
    assert pinned_bytes_per_worker(tp2) * 2 >= tp2.pod.pool_bytes_per_engine
    assert pinned_bytes_per_worker(tp2) < tp2.pod.pool_bytes_per_engine


def test_every_shortfall_is_reported_together():
    facts = Facts(0, 64 * MIB, MIB, "memory.max", 64 * 1024, False)
    found = shortfalls(PLAN, facts, Path("/dev/shm"), pins=True)
    assert [s.check for s in found] == ["shm", "memory", "memlock"]
    assert shortfalls(PLAN, PLENTY, Path("/dev/shm"), pins=True) == []


# ------------------------------------------------------------ the cgroup's limit


def test_memory_limit_v2(tmp_path):
    (tmp_path / "memory.max").write_text("8589934592\n")
    assert memory_limit(tmp_path) == (8 * GIB, str(tmp_path / "memory.max"))
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit(tmp_path)[0] is None


def test_memory_limit_v1(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    assert memory_limit(tmp_path)[0] == 4 * GIB
    # v1's "no limit"
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_limit(tmp_path)[0] is None


def test_memory_limit_absent_or_unreadable(tmp_path):
    limit, source = memory_limit(tmp_path)
    assert limit is None and str(tmp_path) in source
    (tmp_path / "memory.max").write_text("lots\n")
    with pytest.raises(preflight.PreflightError, match="cannot read the memory limit"):
        memory_limit(tmp_path)


def test_facts_of_a_real_folder_and_cgroup(tmp_path):
    (tmp_path / "memory.max").write_text(f"{3 * GIB}\n")
    facts = preflight.read_facts(tmp_path, tmp_path)
    assert 0 < facts.shm_free <= facts.shm_total
    assert facts.memory_limit == 3 * GIB
    assert facts.memlock_soft == resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    with pytest.raises(preflight.PreflightError, match="cannot read the shm folder"):
        preflight.read_facts(tmp_path / "missing", tmp_path)


def test_cap_ipc_lock_is_read_from_capeff(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000004000\n")
    assert preflight.has_cap_ipc_lock(status)
    status.write_text("Name:\tx\nCapEff:\t00000000a80425fb\n")  # docker's default set
    assert not preflight.has_cap_ipc_lock(status)


# ---------------------------------------------- serve: exit 3, one line, termination log


def _serve(tmp_path: Path, monkeypatch, capsys, *argv: str) -> tuple[int, str, Path]:
    from .test_engine_serve import write

    path = write(tmp_path, PLAN, {"model": "m"})
    calls: list[Any] = []
    monkeypatch.setattr(serve.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(serve, "plugin_registered", lambda: True)
    log = tmp_path / "termination-log"
    monkeypatch.setenv("SPILLWAY_TERMINATION_LOG", str(log))
    code = cli.main(["serve", "--plan", str(path), *argv])
    err = capsys.readouterr().err
    assert (code == 0) == bool(calls)  # vLLM is exec'd only when everything fits
    return code, err, log


def test_serve_stops_on_a_memory_shortfall_with_one_line(tmp_path, monkeypatch, capsys):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    shm = tmp_path / "shm"
    shm.mkdir()
    code, err, log = _serve(
        tmp_path, monkeypatch, capsys, "--shm-dir", str(shm), "--cgroup-root", str(cgroup)
    )
    assert code == 3
    [line] = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("spillway-engine: error: preflight: memory: container memory limit")
    assert f"{4 * GIB} bytes" in line
    assert log.read_text() == line


def test_serve_frees_leftovers_and_passes_preflight(tmp_path, monkeypatch, capsys):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "psm_0badf00d").write_bytes(b"\1" * 8192)
    (shm / "someone-elses").write_bytes(b"keep")
    monkeypatch.setenv("SPILLWAY_SHM_DIR", str(shm))
    monkeypatch.setenv("SPILLWAY_CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    code, err, log = _serve(tmp_path, monkeypatch, capsys)
    assert code == 0
    assert f"freed leftover {shm / 'psm_0badf00d'}: 8192 bytes" in err
    assert "preflight ok" in err
    assert sorted(p.name for p in shm.iterdir()) == ["someone-elses"]
    assert not log.exists()


def test_serve_warns_on_memlock_and_still_starts(tmp_path, monkeypatch, capsys):
    low = Facts(64 * GIB, 64 * GIB, None, "none", 8 * MIB, False)
    monkeypatch.setattr(preflight, "read_facts", lambda shm, cgroups: low)
    (tmp_path / "shm").mkdir()
    code, err, log = _serve(tmp_path, monkeypatch, capsys, "--shm-dir", str(tmp_path / "shm"))
    assert code == 0
    [line] = [x for x in err.splitlines() if "warning" in x]
    assert line.startswith("spillway-engine: warning: preflight: memlock:")
    assert f"is {8 * MIB} bytes" in line
    assert not log.exists()


def test_serve_refuses_a_missing_shm_folder(tmp_path, monkeypatch, capsys):
    code, err, log = _serve(tmp_path, monkeypatch, capsys, "--shm-dir", str(tmp_path / "no"))
    assert "does not exist" in err
    assert code == 3 and "does not exist" in log.read_text()


def test_preflight_end_to_end_through_the_console_script(tmp_path):
    """``spillway-engine serve`` as the pod runs it (a real process, no vLLM needed
    before the preflight): a container limit below the plan stops it with exit 3 and
    the one line on stderr and in the termination log."""
    from .test_engine_serve import write

    path = write(tmp_path, PLAN, {"model": "m"})
    cgroup = tmp_path / "cgroup"
    (cgroup / "memory").mkdir(parents=True)
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (tmp_path / "shm").mkdir()
    env = dict(os.environ)
    env.update(
        SPILLWAY_SHM_DIR=str(tmp_path / "shm"),
        SPILLWAY_CGROUP_ROOT=str(cgroup),
        SPILLWAY_TERMINATION_LOG=str(tmp_path / "termination-log"),
    )
    # vLLM's version and plugin checks come first; run them in the same interpreter
    # with both answered as in the engine image.
    code = (
        "import sys; from spillway_engine import cli; from spillway_engine.launcher import serve; "
        "serve.installed_vllm_version = lambda: '0.33.0'; "
        "serve.plugin_registered = lambda: True; "
        "sys.exit(cli.main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", "--plan", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    [line] = done.stderr.strip().splitlines()[-1:]
    assert "preflight: memory:" in line and f"{2 * GIB} bytes" in line
    assert (tmp_path / "termination-log").read_text() == line
    assert "exec vllm" not in done.stderr


# ------------------------------------------------------------------ shm cleanup


def test_leftover_names():
    for name in (
        "vllm_offload_3f2a.mmap",
        "vllm_offload_3f2a.mmap.7",
        "vllm_ec_x.mmap",
        "psm_9878674e",
        "sem.mp-47tb4mxn",
        "nccl-abc",
        "torch_123_456",
    ):
        assert is_leftover_name(name), name
    for name in ("vllm_offload_x", "my-data", "psm", "sem.other", ".hidden"):
        assert not is_leftover_name(name), name


def test_free_leftovers_reports_what_it_held(tmp_path):
    (tmp_path / "vllm_offload_a.mmap").write_bytes(b"\1" * (3 * 4096))
    with open(tmp_path / "vllm_offload_b.mmap", "wb") as f:
        f.truncate(4 * MIB)  # sparse, as an engine killed before its workers mapped it
    (tmp_path / "keep.txt").write_text("x")
    done = free_leftovers(tmp_path)
    freed = {f.name: (f.used_bytes, f.size_bytes) for f in done.freed}
    assert freed["vllm_offload_a.mmap"] == (3 * 4096, 3 * 4096)
    assert freed["vllm_offload_b.mmap"][1] == 4 * MIB
    assert freed["vllm_offload_b.mmap"][0] < 4 * MIB
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    lines = done.log_lines()
    assert any("vllm_offload_a.mmap: 12288 bytes" in x for x in lines)
    assert lines[-1].startswith("freed 2 leftover file(s)")


def test_a_file_a_live_process_maps_is_kept(tmp_path):
    path = tmp_path / "psm_live"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    os.close(fd)  # only the mapping holds it now, as vLLM's region and rings do
    try:
        done = free_leftovers(tmp_path)
        assert done.in_use == ("psm_live",) and done.freed == ()
        assert path.exists()
        assert any("a running process uses it" in x for x in done.log_lines())
    finally:
        m.close()
    assert [f.name for f in free_leftovers(tmp_path).freed] == ["psm_live"]


def test_shm_dir_flag_then_env_then_default(monkeypatch):
    monkeypatch.delenv("SPILLWAY_SHM_DIR", raising=False)
    assert shm_dir() == Path("/dev/shm")
    monkeypatch.setenv("SPILLWAY_SHM_DIR", "/x")
    assert shm_dir() == Path("/x")
    assert shm_dir("/y") == Path("/y")


def test_the_disk_tier_folder_must_take_files(tmp_path: Path):
    plan = plan_for(disk_bytes=4 * GIB)
    assert preflight.check_disk(plan_for(), tmp_path) is None  # no disk tier: no check
    assert preflight.check_disk(plan, tmp_path) is None
    assert not list(tmp_path.iterdir())  # the probe file is gone
    missing = preflight.check_disk(plan, tmp_path / "not-mounted")
    assert missing is not None and missing.fatal and missing.check == "disk"
    assert "does not take files (No such file or directory)" in missing.line
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        assert preflight.check_disk(plan, tmp_path / "ro").fatal


def test_a_disk_smaller_than_the_tier_is_a_warning(tmp_path: Path, monkeypatch):
    plan = plan_for(disk_bytes=4 * GIB, disk_writers=2)
    real = os.statvfs(tmp_path)
    tiny = os.statvfs_result((real.f_bsize, 4096, (1 * GIB) // 4096, *real[3:]))
    monkeypatch.setattr(preflight.os, "statvfs", lambda _: tiny)
    found = preflight.check_disk(plan, tmp_path)
    assert found is not None and not found.fatal
    assert f"less than this pod's share of the disk tier, {2 * GIB} bytes" in found.line
