"""The connector's pool cut to what every pipeline stage holds (``shared_stage_units``):
the plan's ``spillway_group_units`` / ``spillway_num_units`` taken over the worker's
own figures, and refused, naming the key, where they cannot hold this worker's chunks."""

from __future__ import annotations

import pytest

from spillway_engine.offloader.geometry import SpillwayConfigError, shared_stage_units
from spillway_engine.planner.offload_geometry import unit_pool

GIB = 2**30
#: stage 0 of gpt-oss-120b at 17,19 (TP4 x PP2): 9 sliding and 8 full layers a block
STAGE0 = unit_pool(64 * GIB, 16, [(0, "SlidingWindow", 16, 9 * 8192),
                                  (1, "FullAttention", 16, 8 * 8192)], 8)


def test_without_the_keys_the_pool_is_the_workers_own():
    assert shared_stage_units(STAGE0, {"cpu_bytes_to_use": 64 * GIB}, (0, 1)) is STAGE0


def test_the_plan_s_units_and_count_replace_the_worker_s():
    assert STAGE0.units == (9, 8) and STAGE0.num_units == 1048576
    pool = shared_stage_units(
        STAGE0, {"spillway_group_units": [9, 10], "spillway_num_units": 1000}, (0, 1)
    )
    assert (pool.units, pool.num_units, pool.unit_bytes) == ((9, 10), 1000, STAGE0.unit_bytes)
    assert pool.num_chunks == 1000 // 19


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"spillway_group_units": [9, 10]}, "give both 'spillway_group_units' and "),
        ({"spillway_group_units": [9], "spillway_num_units": 100}, "has 1 entries, but this "
                                                                   "engine offloads 2"),
        ({"spillway_group_units": [9, 7], "spillway_num_units": 100}, r"KV-cache group 1 "
                                                                      "gets 7 units a chunk"),
        ({"spillway_group_units": [9, 10], "spillway_num_units": 2**21},
         r"\['spillway_num_units'\] 2097152 is outside this worker's pool of 1048576"),
        ({"spillway_group_units": [9, 10], "spillway_num_units": 18}, "at least 19"),
        ({"spillway_group_units": "9,10", "spillway_num_units": 100}, "list of integers"),
    ],
)
def test_figures_that_cannot_hold_this_worker_are_refused_naming_the_key(extra, match):
    with pytest.raises(SpillwayConfigError, match=match):
        shared_stage_units(STAGE0, extra, (0, 1))
