"""Each GPU pool's measured rate, and what it is worth against the others (pure).

One InferenceDeployment may serve on several GPU pools (spec.resources.gpuPools): an
H100 replica answers faster than an A100 one. The router measures each pool's rate as
the prompt tokens its pods take through per second of request time (a moving average
over the requests it proxied) and weighs each pod by its pool's rate over the mean of
the model's pools: a pod of a pool twice as fast may carry twice the load before cold
requests look elsewhere, and its prefill and queue estimates are halved. A pool not
measured yet, or a model on one pool, weighs 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

#: weight of the newest request in the moving average
ALPHA = 0.2
#: weights are kept within [1 / BOUND, BOUND]: one slow answer never starves a pool
BOUND = 4.0


@dataclass
class PoolRates:
    """Tokens per second per pool key (``namespace/deployment/pool``)."""

    rates: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def observe(self, pool: str | None, tokens: int, seconds: float) -> None:
        if pool is None or tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.rates.get(pool)
        self.rates[pool] = rate if old is None else (1 - ALPHA) * old + ALPHA * rate
        self.samples[pool] = self.samples.get(pool, 0) + 1

    def weights(self, pools: Iterable[str | None]) -> dict[str | None, float]:
        """Each pool's weight among ``pools`` (those of the model's ready pods): its
        rate over the mean of the measured ones, bounded; 1 where unmeasured."""
        pools = set(pools)
        measured = {p: self.rates[p] for p in pools if p is not None and p in self.rates}
        if len(measured) < 2:
            return dict.fromkeys(pools, 1.0)
        mean = sum(measured.values()) / len(measured)
        return {p: min(BOUND, max(1 / BOUND, measured[p] / mean)) if p in measured else 1.0
                for p in pools}
