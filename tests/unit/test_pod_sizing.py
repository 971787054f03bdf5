import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_engine.planner.pod_sizing import (
    ENGINE_PROCESS_BYTES,
    GIB,
    MIN_HEADROOM_BYTES,
    SHM_QUEUE_BYTES,
    WORKER_PROCESS_BYTES,
    PodSizingError,
    max_pool_bytes,
    max_pool_bytes_for_node,
    size_pod,
)


def test_terms_add_up():
    pod = size_pod(64 * GIB, workers_per_engine=8, data_parallel_size=1)
    assert pod.shm_bytes == 64 * GIB + SHM_QUEUE_BYTES
    processes = ENGINE_PROCESS_BYTES + 8 * WORKER_PROCESS_BYTES
    assert pod.process_overhead_bytes == processes
    assert pod.memory_request_bytes == pod.shm_bytes + processes
    assert pod.memory_limit_bytes == pod.memory_request_bytes + pod.headroom_bytes
    # 5% beats the 2 GiB floor, rounded up to whole MiB
    assert 0 <= pod.headroom_bytes - pod.memory_request_bytes // 20 < 2**20


def test_data_parallel_multiplies_pool_and_processes():
    one = size_pod(10 * GIB, 2, 1)
    two = size_pod(10 * GIB, 2, 2)
    assert two.shm_bytes - SHM_QUEUE_BYTES == 2 * (one.shm_bytes - SHM_QUEUE_BYTES)
    assert two.process_overhead_bytes == 2 * one.process_overhead_bytes


def test_small_pod_gets_minimum_headroom():
    assert size_pod(0, 1, 1).headroom_bytes == MIN_HEADROOM_BYTES


def test_limit_too_small():
    with pytest.raises(PodSizingError, match="no room"):
        max_pool_bytes(8 * GIB, workers_per_engine=4, data_parallel_size=1)
    with pytest.raises(PodSizingError):
        size_pod(-1, 1, 1)


@settings(max_examples=300)
@given(
    limit=st.integers(32 * GIB, 4096 * GIB),
    workers=st.integers(1, 8),
    dp=st.integers(1, 4),
)
def test_max_pool_inverts_size_pod(limit, workers, dp):
    try:
        pool = max_pool_bytes(limit, workers, dp)
    except PodSizingError:
        assert size_pod(0, workers, dp).memory_limit_bytes > limit - 2**20 * (dp + 2)
        return
    assert size_pod(pool, workers, dp).memory_limit_bytes <= limit
    # and it is (nearly) the largest: 64 MiB more per engine no longer fits
    assert size_pod(pool + 64 * 2**20, workers, dp).memory_limit_bytes > limit


def test_node_is_split_between_pods():
    node = 2048 * GIB
    one_pod = max_pool_bytes_for_node(
        node, gpus_per_node=8, workers_per_engine=8, data_parallel_size=1
    )
    four_pods = max_pool_bytes_for_node(node, 8, 2, 1)
    assert one_pod == max_pool_bytes(node, 8, 1)
    assert four_pods == max_pool_bytes(node // 4, 2, 1)
    assert size_pod(four_pods, 2, 1).memory_limit_bytes * 4 <= node
    with pytest.raises(PodSizingError, match="GPUs"):
        max_pool_bytes_for_node(node, 4, 8, 1)


# ------------------------------------------- data parallelism: whose budget is it


def _plan(**kw):
    from spillway_engine.planner.plan import PlanRequest, make_plan

    from .planner_fixtures import load_model

    return make_plan(load_model("llama-3.2-1b"), PlanRequest(max_model_len=8192, **kw))


def test_plan_says_the_budget_is_per_engine_by_default_and_shows_the_pod_total():
    plan = _plan(cpu_memory_bytes=8 * GIB, data_parallel_size=2)
    pod = plan.pod
    assert pod.host_memory_scope == "engine" and pod.engines == 2
    assert plan.cpu_memory_bytes == 8 * GIB
    assert pod.pool_bytes_per_pod == 2 * pod.pool_bytes_per_engine
    assert pod.shm_bytes >= pod.pool_bytes_per_pod


def test_a_per_pod_budget_is_split_across_the_engines():
    per_pod = _plan(cpu_memory_bytes=16 * GIB, data_parallel_size=2, host_memory_scope="pod")
    per_engine = _plan(cpu_memory_bytes=8 * GIB, data_parallel_size=2)
    assert per_pod.pod.host_memory_scope == "pod"
    assert per_pod.cpu_memory_bytes == 8 * GIB
    assert per_pod.pod.pool_bytes_per_pod == per_engine.pod.pool_bytes_per_pod <= 16 * GIB
    assert per_pod.pod.shm_bytes == per_engine.pod.shm_bytes
    # one engine: the two readings agree
    assert _plan(cpu_memory_bytes=8 * GIB, host_memory_scope="pod").pod == _plan(
        cpu_memory_bytes=8 * GIB
    ).pod.model_copy(update={"host_memory_scope": "pod"})


def test_spillway_plan_table_shows_per_engine_and_per_pod():
    from spillway_cli.main import render_table

    text = render_table(_plan(cpu_memory_bytes=16 * GIB, data_parallel_size=2,
                              host_memory_scope="pod"))
    assert "8.00 GiB per engine (budget given per pod)" in text
    assert "2 engine(s) per pod: 16.00 GiB mapped per pod" in text
