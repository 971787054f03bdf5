"""Small helpers shared by the test tiers."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator


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


@contextlib.contextmanager
def fresh_namespace(api, name: str) -> Iterator[str]:
    """Create namespace ``name`` and wait for its default ServiceAccount (pods need it
    under the ServiceAccount admission plugin); on exit delete it and wait for its pods
    to go, so the GPUs they held are free for the next test."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, 30, f"default SA in {name}")
    try:
        yield name
    finally:
        core.delete_namespace(name)
        wait_for(lambda: not core.list_namespaced_pod(name).items, 60, f"pods of {name} to go")


def http_get(url: str, timeout: float = 30) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error is its status and body, and a server that
    does not answer is status 0 with the reason (so a wait can poll one that starts)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


#: The GPU of the second pool in the GPU pool tests (unit and integration) beside an H100
#: one: issue 43's H100 + B200 pair (any catalogue GPU that plans works here).
SECOND_GPU = "b200"
