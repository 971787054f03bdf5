"""Small helpers shared by the test tiers."""

from __future__ import annotations

import time


def wait_for(check, timeout: float, what: str, interval: float = 0.2, on_timeout=None):
    """Poll ``check`` until it returns something truthy; fail with ``what`` on timeout
    (``on_timeout()``, if given, adds what the world looked like)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    seen = f"; state: {on_timeout()!r}" if on_timeout else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r}){seen}")
