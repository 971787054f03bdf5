"""Whether a process is still alive, and how a harness stops its child: the one answer
every harness here uses for each."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie is dead: our own child is reaped here, and
    another's is read as such from ``/proc`` (``kill(pid, 0)`` answers for both)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:  # a zombie that is not our child
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stop(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM a running child, SIGKILL it if it has not ended within ``grace`` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
