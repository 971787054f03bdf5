"""Offload geometry. Expected figures: vllm-offload.md section 6.3 (100 GiB pool)."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_engine.planner.families import model_shape
from spillway_engine.planner.gpus import get_gpu
from spillway_engine.planner.kv_layout import KVGroup, LayoutRequest, compute_layout
from spillway_engine.planner.offload_geometry import (
    OffloadRefused,
    OffloadRequest,
    host_units,
    resolve_blocks_per_chunk,
    spillway_geometry,
    true_bytes_per_block,
    upstream_geometry,
)
from tests.unit.planner_fixtures import load_model

GIB100 = 100 * 2**30
L128K = 131072

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
}


def lay(config, tp=1, gpu="h100", **kw):
    config = load_model(config) if isinstance(config, str) else config
    kw.setdefault("max_model_len", L128K)
    return compute_layout(
        model_shape(config), get_gpu(gpu), LayoutRequest(tensor_parallel_size=tp, **kw)
    )


def req(tp=1, cpu=GIB100, **kw):
    return OffloadRequest(cpu_bytes=cpu, world_size=tp, max_model_len=L128K, **kw)


@pytest.mark.parametrize(
    ("model", "tp", "bpc", "row", "chunks", "gauge"),
    [
        ("gemma-3-27b-it", 1, 16, 20_971_520, 5120, 1_252_031),
        ("gemma-3-27b-it", 4, 16, 20_971_520, 5120, 1_252_031),
        (GPT_OSS_20B, 1, 16, 6_291_456, 17_066, 4_360_379),
        (GPT_OSS_20B, 4, 16, 6_291_456, 17_066, 4_360_379),
        ("qwen3-next-80b-a3b-instruct", 1, 1, 14_155_776, 7585, 4_303_814),
        ("qwen3-next-80b-a3b-instruct", 4, 1, 15_728_640, 6826, 2_166_337),
        ("deepseek-v3", 1, 16, 17_989_632, 5968, 1_527_808),
        ("deepseek-v3", 4, 16, 17_989_632, 5968, 1_527_808),  # replicated MLA: one copy
    ],
)
def test_upstream_matches_reference(model, tp, bpc, row, chunks, gauge):
    geo = upstream_geometry(lay(model, tp), req(tp, blocks_per_chunk=bpc))
    assert (geo.row_bytes, geo.num_chunks, geo.gauge_tokens) == (row, chunks, gauge)
    assert geo.kv_connector_extra_config == {"cpu_bytes_to_use": GIB100, "blocks_per_chunk": bpc}


def test_chunked_local_window_chunks():
    geo = upstream_geometry(lay("llama-4-scout-17b-16e"), req(blocks_per_chunk=16))
    assert [g.window_chunks for g in geo.groups] == [32, 32, 32, None]  # 8192 / 256


def test_mla_not_replicated_off_single_node():
    geo = upstream_geometry(lay("deepseek-v3", 4), req(4, blocks_per_chunk=16, single_node=False))
    assert (geo.copies, geo.row_bytes, geo.num_chunks) == (4, 71_958_528, 1492)


def test_default_blocks_per_chunk():
    assert resolve_blocks_per_chunk(lay("llama-3.2-1b"), req()) == 16  # 256 tokens
    assert resolve_blocks_per_chunk(lay("qwen3-next-80b-a3b-instruct"), req()) == 1
    assert resolve_blocks_per_chunk(lay("deepseek-v3", kv_cache_dtype="fp8"), req()) == 4


def test_block_size_key_checks():
    llama = lay("llama-3.2-1b")
    assert resolve_blocks_per_chunk(llama, req(chunk_block_size_tokens=256)) == 16
    with pytest.raises(OffloadRefused, match="use 256"):
        resolve_blocks_per_chunk(llama, req(chunk_block_size_tokens=250))
    with pytest.raises(OffloadRefused, match="not both"):
        resolve_blocks_per_chunk(llama, req(chunk_block_size_tokens=256, blocks_per_chunk=4))
    with pytest.raises(OffloadRefused, match="greater than 0"):
        resolve_blocks_per_chunk(llama, req(blocks_per_chunk=0))
    mixed = dataclasses.replace(
        llama,
        groups=(
            KVGroup("full_attention", (0,), 16, 4096),
            KVGroup("sliding_window", (1,), 64, 4096, sliding_window=512),
        ),
    )
    with pytest.raises(OffloadRefused, match="same tokens per block"):
        resolve_blocks_per_chunk(mixed, req(chunk_block_size_tokens=256))
    # blocks_per_chunk works for mixed groups: each group's chunk spans tpb x bpc
    geo = upstream_geometry(mixed, req(blocks_per_chunk=4))
    assert [g.tokens_per_chunk for g in geo.groups] == [64, 256]
    # Spillway: one span for both groups
    sp = spillway_geometry(mixed, req(blocks_per_chunk=4))
    assert sp.chunk_tokens == 64
    assert [g.blocks_per_chunk for g in sp.groups] == [4, 1]


def test_pool_checks():
    llama = lay("llama-3.2-1b")
    with pytest.raises(OffloadRefused, match="smaller than one row"):
        upstream_geometry(llama, req(cpu=1024))
    with pytest.raises(OffloadRefused, match="positive"):
        upstream_geometry(llama, req(cpu=0))
    with pytest.raises(OffloadRefused, match="smaller than one chunk of every KV-cache group"):
        spillway_geometry(llama, req(cpu=1024))


def test_hash_unit_assert_without_prefix_caching():
    hybrid = lay("qwen3-next-80b-a3b-instruct", enable_prefix_caching=False, max_model_len=8192)
    with pytest.raises(OffloadRefused, match="hash unit"):
        upstream_geometry(hybrid, req())
    with pytest.raises(OffloadRefused, match="prefix caching"):
        spillway_geometry(hybrid, req())


def test_spillway_single_group_equals_upstream():
    llama = lay("llama-3.1-70b-instruct", 8)
    up = upstream_geometry(llama, req(8))
    sp = spillway_geometry(llama, req(8))
    assert sp.chunk_tokens == 256
    assert (sp.chunk_set_bytes, sp.num_chunks) == (up.row_bytes, up.num_chunks)
    assert sp.capacity_tokens == up.capacity_tokens == up.num_chunks * 256


def test_spillway_rows_sized_per_group():
    gemma = lay("gemma-3-27b-it")
    sp = spillway_geometry(gemma, req())
    assert [g.row_bytes for g in sp.groups] == [9 * 131072 * 16] * 4 + [8 * 131072 * 16] * 2 + [
        10 * 131072 * 16
    ]
    up = upstream_geometry(gemma, req())
    # upstream spends a largest-group row on every group key
    assert sp.capacity_tokens > up.capacity_tokens


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(
        [
            "llama-3.2-1b",
            "gemma-3-27b-it",
            "gemma-3-1b-it",
            "gpt-oss-120b",
            "qwen3-next-80b-a3b-instruct",
            "deepseek-v2-lite",
            "jamba-mini-1.5",
            "nemotron-h-8b-base-8k",
        ]
    ),
    tp=st.sampled_from([1, 2, 4]),
    bpc=st.one_of(st.none(), st.integers(1, 64)),
    pool=st.integers(2**30, 2**40),
)
def test_spillway_invariants(model, tp, bpc, pool):
    layout = lay(model, tp)
    try:
        sp = spillway_geometry(layout, req(tp, cpu=pool, blocks_per_chunk=bpc))
    except OffloadRefused:
        # only a pool below one chunk of every group is refused
        big = spillway_geometry(layout, req(tp, cpu=2**50, blocks_per_chunk=bpc))
        assert pool < big.chunk_set_bytes
        return
    t = sp.chunk_tokens
    assert t % layout.tokens_per_hash == 0
    for g, group in zip(sp.groups, layout.groups, strict=True):
        assert g.blocks_per_chunk * g.tokens_per_block == t
        assert g.chunk_bytes == true_bytes_per_block(layout, group) * g.blocks_per_chunk * sp.copies
        assert g.row_bytes == g.units * sp.unit_bytes * sp.copies >= g.chunk_bytes
    # byte-exact slots: one page of slack per group at most, and >= 95% fill
    assert sp.unit_bytes % 4096 == 0
    true_bytes = sum(g.chunk_bytes for g in sp.groups)
    assert true_bytes >= 0.95 * sp.chunk_set_bytes
    assert sp.num_chunks == sp.num_units // sum(g.units for g in sp.groups)
    assert sp.region_bytes == sp.num_units * sp.unit_bytes * sp.copies
    assert sp.region_bytes <= pool < sp.region_bytes + sp.unit_bytes * sp.copies
    assert sp.capacity_tokens == sp.num_chunks * t
    try:
        up = upstream_geometry(layout, req(tp, cpu=pool, blocks_per_chunk=bpc))
    except OffloadRefused:
        big = upstream_geometry(layout, req(tp, cpu=2**50, blocks_per_chunk=bpc))
        assert pool < big.row_bytes
        return
    assert up.region_bytes <= pool < up.region_bytes + up.row_bytes
    assert up.row_bytes == math.ceil(up.kv_bytes_per_chunk / 4096) * 4096


def test_host_units():
    # equal groups: one unit per chunk (upstream's row)
    assert host_units([8192, 8192]) == (8192, [1, 1])
    # Gemma-3-27B-like 10/9/8-layer groups: exact one-layer units
    layer = 2 * 1024 * 1024
    assert host_units([10 * layer, 9 * layer, 8 * layer]) == (layer, [10, 9, 8])
    # unit is page aligned even for tiny chunks
    unit, units = host_units([100, 5000])
    assert unit % 4096 == 0 and units == [1, 2]
    with pytest.raises(ValueError):
        host_units([])
