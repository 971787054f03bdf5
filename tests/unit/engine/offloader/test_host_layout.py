"""HostLayout.from_plan: the one way from a plan to the host pool's layout."""

from __future__ import annotations

import pytest

from spillway_engine.offloader.host_layout import HostLayout
from spillway_engine.planner.plan import read_plan
from tests.unit.simulator_support import DEEPSEEK, GEMMA, PLANS, QWEN_NEXT


@pytest.mark.parametrize("name", [GEMMA, DEEPSEEK, QWEN_NEXT])
def test_from_plan_takes_the_spillway_section(name: str) -> None:
    plan = read_plan((PLANS / name).read_text(), name)
    sw = plan.spillway
    layout = HostLayout.from_plan(plan)
    assert (layout.chunk_tokens, layout.unit_bytes, layout.copies, layout.num_units) == (
        sw.chunk_tokens, sw.unit_bytes, sw.copies, sw.num_units)  # fmt: skip
    assert layout.region_bytes == sw.region_bytes
    assert [g.position for g in layout.groups] == list(range(len(sw.groups)))
    for slot, g in zip(layout.groups, sw.groups, strict=True):
        assert slot.group_id == g.group_index
        assert (slot.tokens_per_block, slot.blocks_per_chunk, slot.units, slot.window_chunks) == (
            g.tokens_per_block, g.blocks_per_chunk, g.units, g.window_chunks)  # fmt: skip
        # the plan counts every rank's bytes, a slot one worker's
        assert slot.chunk_bytes * sw.copies == g.chunk_bytes


def test_a_tensor_parallel_plan_splits_chunk_bytes_per_worker() -> None:
    plan = read_plan((PLANS / QWEN_NEXT).read_text(), QWEN_NEXT)
    assert plan.spillway.copies == 4
    layout = HostLayout.from_plan(plan)
    assert [g.chunk_bytes for g in layout.groups] == [
        g.chunk_bytes // 4 for g in plan.spillway.groups
    ]
