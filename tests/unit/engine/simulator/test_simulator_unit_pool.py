"""The simulator's host pool for Spillway plans is the shipped one: one pool of units,
one LRU over every group's keys, all-or-nothing stores, pinned keys kept.

(The simulator once gave every group its own ``num_chunks`` rows: on Gemma-3-1B with
an 8-chunk pool it exported ``spillway_host_pool_used_chunks`` 56 against a capacity
of 8.)
"""

from __future__ import annotations

from prometheus_client import generate_latest

from spillway_engine.simulator.prom import SimulatorMetrics
from tests.unit.simulator_support import GEMMA, LLAMA, make_core, run_one, tokens


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported")


def test_gemma_used_chunks_never_exceed_the_capacity():
    core = make_core(GEMMA, gpu_tokens=4096, num_chunks=8)
    exporter = SimulatorMetrics(core)
    seen = []
    for seed in range(6):
        run_one(core, tokens(3000, seed))
        exporter.sync()
        text = generate_latest(exporter.registry).decode()
        capacity = _gauge(text, "spillway_host_pool_capacity_chunks")
        used = _gauge(text, "spillway_host_pool_used_chunks")
        seen.append(used)
        assert capacity == 8
        assert used <= capacity, f"used {used} of {capacity} chunks after request {seed}"
    assert max(seen) > 0
    assert core.counters.host_evictions > 0  # 3000-token prompts overflow 8 chunks


def test_gemma_units_are_the_plans_and_the_lru_is_shared():
    core = make_core(GEMMA, gpu_tokens=4096, num_chunks=8)
    pool = core.pools[0]
    per_chunk = sum(g.units for g in core.plan.groups)  # 4*4 + 2*3 + 4 = 26
    assert per_chunk == 26
    assert pool.capacity == 8 * per_chunk
    run_one(core, tokens(3000, 1))
    # 11 chunks of the full group (4 units) do not fit with the windows' tail chunks
    # (2 chunks x 22 units): the pool holds what the LRU kept, never more than it has.
    assert 0 < pool.used <= pool.capacity
    assert core.host_used_chunks() == pool.used // per_chunk


def test_a_store_larger_than_the_pool_is_refused_whole():
    core = make_core(GEMMA, gpu_tokens=4096, num_chunks=1)
    run_one(core, tokens(3000, 2))
    # one chunk set (26 units) cannot take 11 full chunks (44 units) + windows: nothing
    # is stored, nothing evicted, and vLLM counts an allocation failure
    assert core.pools[0].used == 0
    assert core.counters.allocation_failures == 1
    assert core.counters.host_evictions == 0


def test_upstream_plans_keep_one_row_per_key():
    core = make_core(LLAMA, gpu_tokens=4096, num_chunks=8)
    run_one(core, tokens(3000, 3))
    assert core.host_used_chunks() == 8  # 11 chunks offered, 8 rows
    assert core.counters.host_evictions == 3
