"""Spillway's offloader on vLLM 0.33.0's packed KV blocks (a Mamba + MLA hybrid).

GLM-5 Next's caches are packed block-outermost: one block of the KV allocation holds a
KDA state, an MLA latent, its indexer keys and a tail ring side by side (the groups
overlay each other). vLLM's ``register_kv_caches`` then hands the offloading spec the
whole packed block as the one region of every group, so Spillway's worker saw a chunk of
``block_stride x blocks per chunk`` bytes per group while the plan and the host layout
hold each group's own unpadded pages, and the connector refused to start (issue 33,
item 5: "the worker's chunk for group 0 is 4,764,672 bytes and the host layout's is
4,341,760"). Built here from vLLM's own model class, KV-cache planning, allocation and
``OffloadingConnectorWorker.register_kv_caches`` on the tiny GLM-5 Next config the
emulated-GPU families test starts; no engine process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.worker.utils import allocate_kv_cache

from spillway_engine.emulator.tiny import shrink_config
from spillway_engine.offloader import geometry as geometry_module
from spillway_engine.offloader.geometry import build_geometry, packed_layer_pages, with_extra_config
from spillway_engine.offloader.spec import SpillwayHostSpec
from spillway_engine.planner.plan import PlanRequest, make_plan

from .test_planner_frontier import _cpu_workspace
from .vllm_harness import Case, build_layout

_TESTS = Path(__file__).resolve().parents[1]
_SOURCES = (_TESTS / "contract" / "frontier_configs", _TESTS / "fixtures" / "models")
POOL = 256 << 20
BLOCKS = 12


def _tiny(name: str, layers: int, arch: str) -> dict[str, Any]:
    path = next(p for folder in _SOURCES if (p := folder / f"{name}.json").exists())
    data = json.loads(path.read_text())
    return shrink_config({**data.get("config", data), "architectures": [arch]}, layers)


class Built:
    def __init__(self, config: dict[str, Any], blocks: int = BLOCKS):
        self.plan = make_plan(
            config,
            PlanRequest(tensor_parallel_size=1, gpu="h100", max_model_len=8192,
                        cpu_memory_bytes=POOL, offloader="spillway"),
        )
        _cpu_workspace()
        layout = build_layout(config, Case("tiny", num_gpu_blocks=blocks),
                              self.plan.gpu.attention_backend)
        self.kv_cache_config = layout.kv_cache_config
        self.vllm_config = with_extra_config(
            layout.vllm_config, dict(self.plan.kv_connector_extra_config)
        )
        self.geometry = build_geometry(self.vllm_config, self.kv_cache_config)

    def register(self) -> tuple[SpillwayHostSpec, torch.Tensor]:
        """vLLM's worker side registers freshly allocated KV caches with Spillway's spec."""
        kv = allocate_kv_cache(
            self.kv_cache_config,
            torch.device("cpu"),
            self.vllm_config.cache_config.get_resolved_kv_cache_layout(),
        )
        spec = SpillwayHostSpec(self.geometry.offloading_config, self.geometry)
        worker = OffloadingConnectorWorker(spec, self.vllm_config, self.kv_cache_config)
        with set_current_vllm_config(self.vllm_config):
            worker.register_kv_caches(kv)
        buf = next(iter(kv.values()))
        storage = buf.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return spec, flat


@pytest.fixture(scope="module")
def glm5next(monkeypatch_module: pytest.MonkeyPatch) -> Built:
    monkeypatch_module.setattr(geometry_module, "_uses_shared_region", lambda: True)
    return Built(_tiny("glm-5.3-flash", 4, "Glm5NextForCausalLM"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_packed_pages_are_each_groups_own_and_sum_to_the_planned_chunks(glm5next: Built):
    """Three KDA groups and the MLA group (latent + indexer keys) are offloaded; the
    ring is not. Each layer's page sits inside the packed block, and a group's unpadded
    pages x blocks per chunk are the host layout's chunk and the plan's."""
    layout = glm5next.geometry.layout
    pages = packed_layer_pages(glm5next.kv_cache_config, [g.group_id for g in layout.groups])
    assert pages is not None
    assert [len(p) for p in pages] == [1, 1, 1, 2]
    stride = pages[0][0].block_stride
    for group in pages:
        for p in group:
            assert p.block_stride == stride and p.data_bytes <= p.page_bytes
            assert p.offset + p.page_bytes <= stride  # inside one packed block
    kda_state = pages[0][0]
    assert kda_state.data_bytes < kda_state.page_bytes < stride  # padded, and packed
    planned = glm5next.plan.spillway
    assert [g.group_index for g in planned.groups] == [g.group_id for g in layout.groups]
    for g, group, plan_group in zip(layout.groups, pages, planned.groups, strict=True):
        own = sum(p.data_bytes for p in group) * g.blocks_per_chunk
        assert own == g.chunk_bytes == plan_group.chunk_bytes // planned.copies


def test_spillway_worker_starts_on_packed_blocks_and_moves_each_layers_own_bytes(
    glm5next: Built,
):
    """Failed before the fix: register_kv_caches raised "KV-cache group 0 ... = 4764672
    bytes per chunk, but the host layout's chunk_bytes is 4341760". Now a store of one
    block of every group and a load into other blocks move exactly each layer's
    unpadded page; nothing else in the packed blocks changes."""
    spec, flat = glm5next.register()
    worker = spec._worker
    assert worker is not None
    layout = glm5next.geometry.layout
    pages = packed_layer_pages(glm5next.kv_cache_config, [g.group_id for g in layout.groups])
    assert pages is not None
    gen = torch.Generator().manual_seed(5)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    before = flat.clone()
    assert all(g.blocks_per_chunk == 1 for g in layout.groups)  # one block per chunk
    src = [1, 2, 3, 4]  # a block of each group (a block id is one group's at a time)
    dst = [5, 6, 7, 8]
    units = np.arange(sum(g.units for g in layout.groups))
    n = len(layout.groups)
    store = GPULoadStoreSpec(src, group_sizes=[1] * n, block_indices=[0] * n)
    worker.submit_store(1, store, CPULoadStoreSpec(units.tolist()))
    assert [r.success for r in worker.get_finished()] == [True]
    load = GPULoadStoreSpec(dst, group_sizes=[1] * n, block_indices=[0] * n)
    worker.submit_load(2, CPULoadStoreSpec(units.tolist()), load)
    assert [r.success for r in worker.get_finished()] == [True]
    expected = before.clone()
    for group, s, d in zip(pages, src, dst, strict=True):
        for p in group:
            a = p.offset + s * p.block_stride
            b = p.offset + d * p.block_stride
            expected[b : b + p.data_bytes] = before[a : a + p.data_bytes]
    changed = int((flat != before).sum())
    assert changed > 0
    assert torch.equal(flat, expected)
    worker.shutdown()


def test_unpacked_blocks_keep_vllms_own_refs():
    """A model whose blocks are not packed (Llama: layer-outermost pages) has no packed
    pages: vLLM's per-layer refs reach the worker unchanged."""
    built = Built(_tiny("llama-3.2-1b", 2, "LlamaForCausalLM"), blocks=8192 // 16 + 1)
    groups = [g.group_id for g in built.geometry.layout.groups]
    assert packed_layer_pages(built.kv_cache_config, groups) is None
    spec, _ = built.register()
    assert spec._worker is not None
    spec._worker.shutdown()

