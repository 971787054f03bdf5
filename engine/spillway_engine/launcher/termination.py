"""The container's termination message: one line the kubelet copies into the pod status.

Kubernetes reads ``terminationMessagePath`` (default ``/dev/termination-log``) when a
container exits and puts its text in ``status.containerStatuses[].state.terminated.message``
(and ``lastState`` after a restart), where the operator reads it to say why an engine
did not start (``Degraded``, reason ``EngineStartFailed``). The kubelet keeps at most
4096 bytes; we keep the first line that explains and cut the rest.

``SPILLWAY_TERMINATION_LOG`` overrides the path (tests; a pod that sets a custom
``terminationMessagePath``).
"""

from __future__ import annotations

import os

ENV_TERMINATION_LOG = "SPILLWAY_TERMINATION_LOG"
DEFAULT_PATH = "/dev/termination-log"
#: The kubelet's limit for one container's message.
MAX_BYTES = 4096


def termination_log_path() -> str:
    return os.environ.get(ENV_TERMINATION_LOG) or DEFAULT_PATH


def write_termination_message(message: str) -> bool:
    """Write ``message`` (trimmed to the kubelet's limit) where the kubelet reads it.

    Never raises: outside a pod the default path may not exist or be writable, and a
    failure to explain an exit must not hide the exit itself. Returns whether it wrote.
    """
    data = message.strip().encode("utf-8", "replace")[:MAX_BYTES]
    try:
        with open(termination_log_path(), "wb") as f:
            f.write(data)
    except OSError:
        return False
    return True
