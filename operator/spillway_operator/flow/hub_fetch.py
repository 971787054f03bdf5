"""config.json fetches from the hub, off the reconcile path.

huggingface_hub retries a hub that does not answer (five tries, 1+2+4+8+8 s of back-off:
about 23 s per fetch), and a reconcile worker used to wait for all of it: a few slow
models held every worker and nothing else was reconciled meanwhile. Here each fetch
runs in a thread of its own pool; a reconcile waits for it at most ``wait_seconds``
(a hub that answers does so well within), then answers "fetching" (a temporary
failure, retried) and its object is queued again the moment the fetch ends. A fetch
gets ``budget_seconds`` in all; past that its askers are told the hub gave no answer,
and the next reconcile starts a new one.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

from spillway_operator.plumbing.kube import TemporaryError

T = TypeVar("T")
Reader = tuple[str, str]  # (namespace, name)


class FetchPending(TemporaryError):
    """The fetch runs on: asked again when it ends (or by the retry)."""


class FetchTimedOut(TemporaryError):
    """The fetch ran its whole budget: the next ask starts another."""


class HubFetches:
    def __init__(self, wait_seconds: float = 2.0, budget_seconds: float = 60.0,
                 threads: int = 4):
        self.wait_seconds = wait_seconds
        self.budget_seconds = budget_seconds
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="hub-fetch")
        self._lock = threading.Lock()
        # what was asked -> (its fetch, when it started); the ones told "fetching"
        self._running: dict[Hashable, tuple[concurrent.futures.Future, float]] = {}
        self._waiting: dict[Hashable, set[Reader]] = {}
        #: called (from the fetch's thread) with each reader told "fetching", when the
        #: fetch ends: the controller queues it again
        self.on_done: Callable[[Reader], None] | None = None

    def get(self, asked: Hashable, fetch: Callable[[], T], what: str,
            reader: Reader | None = None) -> T:
        """``fetch()``'s result, or what it raised, if it ends within ``wait_seconds``
        (one fetch per ``asked`` at a time, shared by its askers); else FetchPending,
        or FetchTimedOut once it has run ``budget_seconds``."""
        with self._lock:
            entry = self._running.get(asked)
            if entry is None:
                entry = (self._pool.submit(fetch), time.monotonic())
                self._running[asked] = entry
                entry[0].add_done_callback(lambda _, asked=asked: self._done(asked))
        future, started = entry
        try:
            return future.result(timeout=self.wait_seconds)
        except concurrent.futures.TimeoutError:
            pass
        finally:
            if future.done():
                self._forget(asked, entry)
        if time.monotonic() - started >= self.budget_seconds:
            self._forget(asked, entry)  # its thread may hang on; the next ask starts anew
            raise FetchTimedOut(f"{what}: the hub gave no answer within "
                                 f"{self.budget_seconds:.0f} s") from None
        with self._lock:
            if reader is not None and not future.done():
                self._waiting.setdefault(asked, set()).add(reader)
        raise FetchPending(f"{what}: fetching it from the hub (no answer yet; the object is "
                           "looked at again when it comes)")

    def _forget(self, asked: Hashable, entry: tuple[concurrent.futures.Future, float]) -> None:
        with self._lock:
            if self._running.get(asked) is entry:
                del self._running[asked]

    def _done(self, asked: Hashable) -> None:
        with self._lock:
            readers = self._waiting.pop(asked, set())
        if self.on_done is not None:
            for reader in readers:
                self.on_done(reader)

    def shutdown(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

