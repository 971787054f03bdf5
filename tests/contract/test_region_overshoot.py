"""Overshoot guard: the host region vLLM really maps never outgrows the plan.

Upstream reports host memory well beyond the requested size on a GDN hybrid with data
parallelism (vLLM #53042, about 1.9x as unreclaimable shmem). Spillway sizes the pod's
``/dev/shm`` and memory from ``plan.pod``; if the region the engine maps were larger,
the pod would be killed or its shm refused. Here, for each supported layout (one
group, sliding window + full, GDN hybrid, MLA; TP 1 and 2), the geometry Spillway's
connector derives from vLLM's real ``KVCacheConfig`` allocates vLLM's real
``SharedOffloadRegion`` (as on CUDA, every rank's slots in one mmap), and its mapped
size times the data-parallel engines must not exceed the plan's region, nor the plan's
shm. The only stand-in is for CUDA's choice of the shared region for replicated MLA.
"""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig

from spillway_engine.offloader import geometry as geometry_module
from spillway_engine.offloader.geometry import build_geometry
from spillway_engine.offloader.worker import allocate_host_pool
from spillway_engine.planner.plan import Plan, PlanRequest, make_plan

from .offload_loop import shrunk_config
from .vllm_harness import Case, VllmLayout, build_layout

MIB = 1 << 20
POOL = 48 * MIB  # small: the real region is mapped and this rank's slots pre-faulted

#: (config name, layers kept, what it stands for)
LAYOUTS = [
    ("llama-3.2-1b", 4, "one group"),
    ("gemma-3-1b-it", 6, "sliding window + full"),
    ("qwen3-next-80b-a3b-instruct", 4, "GDN hybrid"),
    ("deepseek-v2-lite", 3, "MLA"),
]


_BUILT: dict[tuple[str, int, int], VllmLayout | Exception] = {}


def _vllm_layout(name: str, layers: int, tp: int, backend: str | None) -> VllmLayout:
    """vLLM's own KV-cache config for the shrunk model (built once per layout)."""
    key = (name, layers, tp)
    if key not in _BUILT:
        case = Case(name, tensor_parallel_size=tp, max_model_len=4096)
        try:
            _BUILT[key] = build_layout(shrunk_config(name, layers), case, backend)
        except Exception as e:  # reported by the test that needs it
            _BUILT[key] = e
    built = _BUILT[key]
    if isinstance(built, Exception):
        pytest.fail(f"vLLM could not build {name} ({layers} layers, TP {tp}): {built!r}")
    return built


def _plan(name: str, layers: int, tp: int, dp: int) -> Plan:
    return make_plan(
        shrunk_config(name, layers),
        PlanRequest(
            model_name=name,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            max_model_len=4096,
            cpu_memory_bytes=POOL,
        ),
    )


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("name", "layers", "kind"), LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_real_region_never_outgrows_the_plan(
    name: str, layers: int, kind: str, tp: int, dp: int, monkeypatch
):
    plan = _plan(name, layers, tp, dp)
    built = _vllm_layout(name, layers, tp, plan.gpu.attention_backend)
    # CUDA keeps replicated MLA in one shared slot; the CPU platform would not
    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    vc = built.vllm_config
    saved = vc.kv_transfer_config
    vc.kv_transfer_config = KVTransferConfig(**plan.kv_transfer_config)
    try:
        host = build_geometry(vc, built.kv_cache_config).layout
        world = vc.parallel_config.world_size
    finally:
        vc.kv_transfer_config = saved
    replicated = host.copies == 1 and world > 1
    pool, cleanup = allocate_host_pool(
        host, f"guard-{name}-tp{tp}", 0, world, replicated, shared=True, barrier=lambda: None
    )
    try:
        mapped = pool.untyped_storage().nbytes()  # the whole mmap vLLM made
    finally:
        del pool
        cleanup()
    print(
        f"\n[{kind} tp{tp} dp{dp}] mapped {mapped} B per engine; plan "
        f"{plan.pod.pool_bytes_per_engine} per engine, {plan.pod.pool_bytes_per_pod} per pod"
    )
    assert mapped == host.region_bytes
    assert mapped <= plan.pod.pool_bytes_per_engine
    assert dp * mapped <= plan.pod.pool_bytes_per_pod
    assert dp * mapped <= plan.pod.shm_bytes
    # and the plan does not hide an overshoot behind a large budget: within a row
    assert plan.pod.pool_bytes_per_engine - mapped < host.unit_bytes * host.copies
