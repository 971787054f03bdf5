"""Whether a process is still alive, the one answer every harness here uses."""

from __future__ import annotations

import contextlib
import os
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
