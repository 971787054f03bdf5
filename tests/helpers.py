"""Small helpers shared by the test tiers."""

from __future__ import annotations

import time


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    """Poll ``check`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
