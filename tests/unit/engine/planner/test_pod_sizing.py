import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_engine.planner.pod_sizing import (
    API_SERVER_BYTES,
    DP_PROCESSES_BYTES,
    ENGINE_CORE_BYTES,
    ENGINE_CORE_MP_BYTES,
    GIB,
    MANAGER_BYTES_PER_KEY,
    MIN_HEADROOM_BYTES,
    MQ_RING_BYTES,
    SHM_OTHER_BYTES,
    WORKER_PROCESS_BYTES,
    PodSizingError,
    max_pool_bytes,
    max_pool_bytes_for_node,
    shm_queue_bytes,
    size_pod,
)


def test_terms_add_up():
    pod = size_pod(64 * GIB, workers_per_engine=8, data_parallel_size=1, host_keys_per_engine=1000)
    # one broadcast ring and one response ring per worker, besides the pool
    assert pod.shm_bytes == 64 * GIB + 9 * MQ_RING_BYTES + SHM_OTHER_BYTES
    processes = (  # eight workers: each a process of its own (mp executor)
        API_SERVER_BYTES
        + ENGINE_CORE_MP_BYTES
        + 1000 * MANAGER_BYTES_PER_KEY
        + 8 * WORKER_PROCESS_BYTES
    )
    assert pod.process_overhead_bytes == processes
    assert pod.memory_request_bytes == pod.shm_bytes + processes
    assert pod.memory_limit_bytes == pod.memory_request_bytes + pod.headroom_bytes
    # 5% beats the 2 GiB floor, rounded up to whole MiB
    assert 0 <= pod.headroom_bytes - pod.memory_request_bytes // 20 < 2**20


def test_one_worker_has_no_message_queue_rings():
    assert shm_queue_bytes(1, 1) == SHM_OTHER_BYTES
    assert shm_queue_bytes(2, 1) == 3 * MQ_RING_BYTES + SHM_OTHER_BYTES
    assert shm_queue_bytes(2, 2) == 6 * MQ_RING_BYTES + SHM_OTHER_BYTES
    # data parallelism runs even one worker per engine in its own process (mp executor)
    assert shm_queue_bytes(1, 2) == 4 * MQ_RING_BYTES + SHM_OTHER_BYTES


def test_the_engine_core_term_follows_vllms_executor():
    """One worker and one engine: vLLM's uni executor runs the worker inside the engine
    core (the larger core term); any other shape runs workers as processes."""
    one = size_pod(0, 1, 1)
    assert one.process_overhead_bytes == (
        API_SERVER_BYTES + ENGINE_CORE_BYTES + WORKER_PROCESS_BYTES
    )
    tp2 = size_pod(0, 2, 1)
    assert tp2.process_overhead_bytes == (
        API_SERVER_BYTES + ENGINE_CORE_MP_BYTES + 2 * WORKER_PROCESS_BYTES
    )
    dp2 = size_pod(0, 1, 2)
    assert dp2.process_overhead_bytes == (
        2 * (API_SERVER_BYTES + ENGINE_CORE_MP_BYTES + WORKER_PROCESS_BYTES)
        + DP_PROCESSES_BYTES
    )


def test_data_parallel_multiplies_pool_and_processes():
    one = size_pod(10 * GIB, 2, 1, 500)
    two = size_pod(10 * GIB, 2, 2, 500)
    assert two.shm_bytes - SHM_OTHER_BYTES == 2 * (one.shm_bytes - SHM_OTHER_BYTES)
    # each engine's processes, and vLLM's DP process manager and coordinator once
    assert two.process_overhead_bytes == 2 * one.process_overhead_bytes + DP_PROCESSES_BYTES


def test_small_pod_gets_minimum_headroom():
    assert size_pod(0, 1, 1).headroom_bytes == MIN_HEADROOM_BYTES


def test_limit_too_small():
    with pytest.raises(PodSizingError, match="no room"):
        max_pool_bytes(8 * GIB, workers_per_engine=4, data_parallel_size=1)
    with pytest.raises(PodSizingError):
        size_pod(-1, 1, 1)


@settings(max_examples=300, deadline=None)  # a loaded machine is not a failure
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


def _plan(model: str = "llama-3.2-1b", **kw):
    from spillway_engine.planner.plan import PlanRequest, make_plan
    from tests.unit.planner_fixtures import load_model

    return make_plan(load_model(model), PlanRequest(max_model_len=8192, **kw))


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


@pytest.mark.parametrize("model", ["llama-3.2-1b", "gemma-3-1b-it", "qwen3-next-80b-a3b-instruct"])
@pytest.mark.parametrize("limit_gib", [24, 200])
@pytest.mark.parametrize("dp", [1, 2])
def test_auto_pool_fits_the_limit_with_the_managers_bytes(model, limit_gib, dp):
    """hostMemory auto: the pool fills the limit, the manager's per-key bytes included."""
    plan = _plan(memory_limit_bytes=limit_gib * GIB, data_parallel_size=dp, model=model)
    assert plan.pod.memory_limit_bytes <= limit_gib * GIB
    keys = plan.spillway.num_units
    assert plan.pod.process_overhead_bytes >= dp * keys * MANAGER_BYTES_PER_KEY
    # nearly all of it: within the rounding and the per-key give-back
    assert limit_gib * GIB - plan.pod.memory_limit_bytes < 64 * 2**20 + dp * keys * 1280
