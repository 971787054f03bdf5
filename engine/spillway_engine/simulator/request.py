"""A simulated request and what the core is told about it: its states, its timing, the
trace entry it came from, the refusal vLLM would give, and the observer of its tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

WAITING, LOADING, RUNNING, FINISHED = "waiting", "loading", "running", "finished"

#: A GPU block (one block of every group in a class) as a mutable triple, for speed:
#: [key (int hash, or None while unnamed), ref (holders), w (pool blocks it weighs)]
_Block = list


class RequestRejected(ValueError):
    """vLLM would answer this request with HTTP 400."""


class Observer(Protocol):
    def on_finished(self, req: SimRequest) -> None: ...
    def on_token(self, req: SimRequest, itl: float | None) -> None: ...


class SimRequest:
    """One request's state; timing fields are filled as it progresses."""

    __slots__ = (
        "admitted",
        "arrival",
        "bkeys",
        "blocks",
        "cached_upto",
        "external_hit",
        "finish_time",
        "first_scheduled",
        "first_token_time",
        "freed_upto",
        "hashes",
        "junction",
        "last_token_time",
        "loaded",
        "local_hit",
        "mamba_want",
        "max_tokens",
        "null_upto",
        "num_computed",
        "num_output",
        "num_preemptions",
        "output_ids",
        "prefill_counted",
        "prompt",
        "prompt_len",
        "ready_at",
        "rid",
        "sink",
        "state",
        "store_keys",
        "target",
        "user_data",
    )

    def __init__(self, rid: Any, prompt: Sequence[int], max_tokens: int, arrival: float):
        self.rid = rid
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.state = WAITING
        self.hashes: list[int] = []
        self.bkeys: list[list[int]] = []  # per class: key of block b (hash of its end)
        self.blocks: list[list[_Block | None]] = []
        self.cached_upto: list[int] = []
        self.freed_upto: list[int] = []
        #: per class: blocks before this index were null at admission (a window
        #: group's blocks before its window at the hit point)
        self.null_upto: list[int] = []
        self.num_computed = 0
        self.num_output = 0
        self.target = self.prompt_len  # tokens to prefill (prompt + outputs after preemption)
        self.admitted = False
        self.ready_at = 0.0
        self.local_hit = 0
        self.external_hit = 0
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.output_ids: list[int] = []
        self.store_keys: list[tuple[int, list[int], int]] | None = None
        #: shared-prefix junction whose window tail / state is retained (vLLM's
        #: ``shared_prefix_boundary``): the GPU full-attention hit when a sparse group
        #: stopped short of it at admission, else 0
        self.junction = 0
        #: the unit pool's keys this request loaded, as (end token, class, key)
        self.loaded: list[tuple[int, int, int]] = []
        #: GPU blocks each Mamba group holds while prefilling (see EngineCore._mamba_want)
        self.mamba_want = 1
        self.prefill_counted = False
        self.sink: Callable[[SimRequest, int, bool], None] | None = None
        self.user_data: Any = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


@dataclass(frozen=True)
class ReplayItem:
    """What the core needs from a trace entry: arrival time, prompt ids, max_tokens."""

    arrival: float
    prompt: Sequence[int]
    max_tokens: int
    rid: Any = None
    #: conversation / prefix id, for prefix-affinity routing across replicas
    session: str | None = None

