"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): the planner against vLLM 0.33.0's own planning.

vLLM builds DeepSeek-V4 on Hopper with FlashMLA's V4 kernels, which a CPU cannot run.
Reconstructed here: vLLM's own model class on the meta device (on a CPU
``vllm.models.deepseek_v4`` picks ``cpu/model.py``, whose attention, indexer and
compressor layers are the same classes as the CUDA model's but for their backend
classes, subclasses with the same block and layout rules: checked below against the
CUDA classes), its layers' own ``get_kv_cache_spec``, the worker's layout resolution
(the indexer's backend declares only block-outermost layouts), vLLM's grouping
(``_get_packed_kv_cache_groups``), ``build_offloading_config`` and
``CPUOffloadingSpec``. The config is DeepSeek-V4-Flash's public config.json facts
(``frontier_configs/deepseek-v4-flash.json``).
"""

from __future__ import annotations

from typing import Any

import pytest

from spillway_engine.planner.plan import Plan, PlanRefused, PlanRequest, make_plan

from .test_planner_frontier import (
    BLOCKS_PER_CHUNK,
    POOL,
    load_frontier,
    planned_groups_as_vllm,
    vllm_windows,
)
from .vllm_harness import Case, VllmLayout, build_layout, vllm_default_max_model_len

FLASH = "deepseek-v4-flash"
CASES = [
    Case(FLASH),
    Case(FLASH, 2),
    Case(FLASH, 4),
    Case(FLASH, 8),
    Case(FLASH, 8, gpu="h200"),
    Case(FLASH, 8, kv_cache_dtype="fp8"),
    Case(FLASH, 2, kv_cache_dtype="fp8"),
    Case(FLASH, 4, kv_cache_dtype="fp8_e4m3"),
    Case(FLASH, 8, max_model_len=65536),
]

_built: dict[Case, VllmLayout | Exception] = {}


def vllm_layout(case: Case) -> VllmLayout | Exception:
    """vLLM's plan of ``case``, built once per session (a refusal is a result too).

    No planned backend is handed to the harness: every DeepSeek-V4 cache layer reports
    its own backend class (``get_attn_backend`` returns the class's ``backend_cls``)."""
    if case not in _built:
        _cpu_workspace()
        try:
            _built[case] = build_layout(load_frontier(case.model), case, None)
        except Exception as e:  # vLLM refusing is a result too
            _built[case] = e
    return _built[case]


def _cpu_workspace() -> None:
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))


def plan_for(case: Case, **kw: Any) -> Plan:
    kw.setdefault("cpu_memory_bytes", POOL)
    kw.setdefault("offloader", "upstream")
    return make_plan(
        load_frontier(case.model),
        PlanRequest(
            tensor_parallel_size=case.tensor_parallel_size,
            gpu=case.gpu,
            kv_cache_dtype=case.kv_cache_dtype,
            max_model_len=case.max_model_len,
            block_size=case.block_size,
            **kw,
        ),
    )


def built(case: Case) -> VllmLayout:
    layout = vllm_layout(case)
    if isinstance(layout, Exception):
        pytest.fail(f"vLLM refused {case} which the planner accepts: {layout!r}")
    return layout


@pytest.mark.parametrize("case", CASES, ids=str)
def test_deepseek_v4_groups_and_offload_match_vllm(case: Case):
    plan = plan_for(case)
    assert plan.gpu.attention_backend == "FLASHMLA_SPARSE_DSV4"
    vllm = built(case)
    assert vllm.vllm_config.cache_config.kv_cache_layout == "BLHNC"
    assert plan.kv_cache_dtype == vllm.vllm_config.cache_config.cache_dtype == "fp8_ds_mla"
    assert planned_groups_as_vllm(plan) == vllm.groups
    assert [{g.sliding_window} for g in plan.kv_groups] == vllm_windows(vllm)
    assert plan.block_size == vllm.block_size == 256
    assert plan.model.num_cache_layers == len(vllm.layer_names) == 167
    for bpc in BLOCKS_PER_CHUNK:
        planned = plan_for(case, blocks_per_chunk=bpc)
        off = vllm.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": planned.blocks_per_chunk})
        assert planned.tokens_per_hash == off["tokens_per_hash"] == 4
        assert planned.worker_bytes_per_block == off["worker_bytes_per_block"]
        up = planned.upstream
        assert up is not None
        assert up.replicated_layout == off["replicated_layout"]
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
        assert up.gauge_tokens == off["gauge_tokens"]
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
        assert [g.window_chunks for g in up.groups] == off["window_chunks"]


def test_deepseek_v4_layer_pages_are_vllm_s_padded_and_unpadded_pages():
    """Each layer's page in each group, and the unpadded page an offloader copies
    (fp8_ds_mla pages round up to 576 B), as vLLM's own specs have them."""
    case = Case(FLASH, 8)
    plan, vllm = plan_for(case), built(case)
    groups = zip(plan.kv_groups, vllm.kv_cache_config.kv_cache_groups, strict=True)
    for index, (group, vgroup) in enumerate(groups):
        specs = [vgroup.kv_cache_spec.kv_cache_specs[n] for n in vgroup.layer_names]
        assert group.layer_page_bytes == [s.page_size_bytes for s in specs]
        assert list(_layout_group(case, index).layer_true_page_bytes) == [
            s.unpadded_page_size_bytes for s in specs
        ]
    assert any(s.page_size_padded for g in vllm.kv_cache_config.kv_cache_groups
               for s in g.kv_cache_spec.kv_cache_specs.values())


def _layout_group(case: Case, index: int) -> Any:
    from spillway_engine.planner.families import model_shape
    from spillway_engine.planner.gpus import get_gpu
    from spillway_engine.planner.kv_layout import LayoutRequest, compute_layout

    layout = compute_layout(
        model_shape(load_frontier(case.model)),
        get_gpu(case.gpu),
        LayoutRequest(tensor_parallel_size=case.tensor_parallel_size),
    )
    return layout.groups[index]


def test_deepseek_v4_flash_layout_in_figures():
    """43 sliding-window latents in two groups (22 + 21, vLLM's layer-pattern split),
    62 compressed caches (21 ratio-4 latents, 20 ratio-128 latents, 21 indexer keys) on
    256-token blocks, 42 ratio-4 compressor states on 4-token blocks, 20 ratio-128 ones
    on 8-token blocks; the hash unit is their gcd, 4 tokens."""
    plan = plan_for(Case(FLASH, 8))
    summary = [(g.kind, len(g.layer_indices), g.tokens_per_block, g.sliding_window)
               for g in plan.kv_groups]
    assert summary == [
        ("sliding_window", 22, 64, 128),
        ("sliding_window", 21, 64, 128),
        ("mla", 62, 256, None),
        ("sliding_window", 42, 4, 8),
        ("sliding_window", 20, 8, 128),
    ]
    latent_4, latent_128, index_key = 64 * 584, 2 * 584, 64 * 132
    assert sorted(set(plan.kv_groups[2].layer_page_bytes)) == [
        -(-latent_128 // 576) * 576, -(-index_key // 576) * 576, -(-latent_4 // 576) * 576
    ]
    assert plan.worker_bytes_per_block == plan.kv_groups[2].bytes_per_block == 1_002_240


def test_cpu_layers_have_the_cuda_layers_rules(monkeypatch: pytest.MonkeyPatch):
    """The CPU model's attention class differs from the one vLLM picks on Hopper only in
    its backend classes; those decide the block size (every backend's kernel pages) and
    the layout (the indexer's declared layouts), and they agree with the CUDA ones."""
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUIndexerBackend
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

    cuda, cpu = DeepseekV4FlashMLAAttention, DeepseekV4CPUAttention
    assert cuda.backend_cls.get_name() == "FLASHMLA_SPARSE_DSV4"
    assert cuda.use_fp8_ds_mla_layout and cpu.use_fp8_ds_mla_layout
    assert (
        cuda.backend_cls.get_supported_kernel_block_sizes()
        == cpu.backend_cls.get_supported_kernel_block_sizes()
        == [256]
    )
    layouts = cuda.backend_cls.supported_kv_cache_layouts()
    assert layouts == cpu.backend_cls.supported_kv_cache_layouts()
    assert issubclass(cuda.swa_backend_cls, DeepseekSparseSWABackend)
    assert cpu.swa_backend_cls is None  # DeepseekV4SWACache's default: the base class
    assert cuda.swa_backend_cls.get_supported_kernel_block_sizes() == (
        DeepseekSparseSWABackend.get_supported_kernel_block_sizes()
    )
    assert cuda.swa_backend_cls.get_preferred_block_size(16) == 256
    assert issubclass(DeepseekV4CPUIndexerBackend, DeepseekV4IndexerBackend)
    assert DeepseekV4IndexerBackend.get_supported_kernel_block_sizes() == [256]
    assert [x.name for x in DeepseekV4IndexerBackend.supported_kv_cache_layouts()] == [
        "BLHNC", "BLNHC"
    ]
    # FlashMLA's V4 kernels run on SM90 (and SM100), not on Ampere/Ada
    assert cuda.backend_cls.supports_compute_capability(DeviceCapability(9, 0))
    for minor in (0, 9):
        assert not cuda.backend_cls.supports_compute_capability(DeviceCapability(8, minor))


def test_hopper_picks_flashmla_s_v4_attention(monkeypatch: pytest.MonkeyPatch):
    """``_select_dsv4_attn_cls`` with no --attention-backend on SM90: FlashMLA's."""
    nvidia = pytest.importorskip("vllm.models.deepseek_v4.nvidia.model")
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    vc = built(Case(FLASH)).vllm_config
    monkeypatch.setattr(
        type(current_platform), "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)),
    )
    assert nvidia._select_dsv4_attn_cls(vc) is DeepseekV4FlashMLAAttention


def test_a_16_bit_cache_is_refused_as_vllm_refuses():
    case = Case(FLASH, 8, kv_cache_dtype="bfloat16")
    refused = vllm_layout(case)
    reason = "fp8_ds_mla layout only supports fp8 kv-cache"
    assert isinstance(refused, ValueError) and reason in str(refused)
    with pytest.raises(PlanRefused, match=reason):
        plan_for(case)


@pytest.mark.parametrize("gpu", ["a100", "l40s"])
def test_off_hopper_is_refused_for_want_of_the_kernels(gpu: str):
    """Not a start-up refusal in vLLM: ``_select_dsv4_attn_cls`` asks no selector and
    FlashMLA's V4 backend (SM90/SM100 only, checked above) fails on the GPU; the planner
    refuses by name."""
    with pytest.raises(PlanRefused, match=r"FLASHMLA_SPARSE_DSV4.*9\.x and 10\.x only"):
        plan_for(Case(FLASH, 8, gpu=gpu))


def test_unmodelled_block_size_and_separate_drafters_are_refused():
    """vLLM takes any multiple of 256 and separate drafters; neither is modelled (a larger
    block changes the compressed pages' block-stride alignment; a drafter's layers sit
    beside the packed groups), so the planner says so rather than guess."""
    with pytest.raises(PlanRefused, match="--block-size 512"):
        plan_for(Case(FLASH, 8, block_size=512))
    with pytest.raises(PlanRefused, match="and a separate drafter is not modelled"):
        plan_for(Case(FLASH, 8), speculative_method="draft_model", num_speculative_tokens=1)


#: --speculative-config method=mtp: vLLM's DeepSeekV4MTP (DeepSeekV4MTPModel)
MTP_CASES = [
    Case(FLASH, 1, speculative_method="mtp", num_speculative_tokens=1),
    Case(FLASH, 2, speculative_method="mtp", num_speculative_tokens=2),
    Case(FLASH, 4, speculative_method="mtp", num_speculative_tokens=3),
    Case(FLASH, 8, speculative_method="mtp", num_speculative_tokens=1),
    Case(FLASH, 8, gpu="h200", kv_cache_dtype="fp8", speculative_method="mtp",
         num_speculative_tokens=3),
]


@pytest.fixture
def cuda_mtp(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CUDA MTP drafter on a CPU. ``vllm.models.deepseek_v4`` exports
    ``cpu/mtp.py``'s stub there (it raises); the CUDA ``DeepSeekV4MTP`` imports on a CPU
    and builds each MTP layer's ``mtp_block`` as a ``DeepseekV4DecoderLayer``: here the
    CPU model's, whose attention and caches are the target's (checked above), as the
    target itself is built."""
    import vllm.models.deepseek_v4 as dsv4
    import vllm.models.deepseek_v4.nvidia.mtp as cuda
    from vllm.models.deepseek_v4.cpu.model import DeepseekV4DecoderLayer

    def decoder_layer(vllm_config: Any, prefix: str, topk_indices_buffer: Any = None,
                      aux_stream_list: Any = None) -> Any:
        return DeepseekV4DecoderLayer(vllm_config, prefix, topk_indices_buffer)

    monkeypatch.setattr(cuda, "DeepseekV4DecoderLayer", decoder_layer)
    monkeypatch.setattr(dsv4, "DeepSeekV4MTP", cuda.DeepSeekV4MTP)


def _mtp_plan(case: Case, **kw: Any) -> Plan:
    return plan_for(case, speculative_method=case.speculative_method,
                    num_speculative_tokens=case.num_speculative_tokens, **kw)


@pytest.mark.parametrize("case", MTP_CASES, ids=str)
def test_deepseek_v4_mtp_groups_and_offload_match_vllm(case: Case, cuda_mtp: None):
    """The MTP layer (layer 43 of 43) is past num_hidden_layers, so vLLM gives it
    compress ratio 1: one more sliding-window latent, whatever the draft tokens; it
    evens the sliding-window groups to 22 + 22."""
    plan = _mtp_plan(case)
    vllm = built(case)
    spec = vllm.vllm_config.speculative_config
    assert spec.method == "mtp"
    assert spec.draft_model_config.architectures == ["DeepSeekV4MTPModel"]
    assert planned_groups_as_vllm(plan) == vllm.groups
    assert [{g.sliding_window} for g in plan.kv_groups] == vllm_windows(vllm)
    assert plan.block_size == vllm.block_size == 256
    assert plan.model.num_cache_layers == len(vllm.layer_names) == 168
    assert [vllm.layer_names[i] for i in plan.draft_layer_indices] == [
        "model.layers.43.attn.swa_cache"
    ]
    assert [g.num_layers for g in plan.kv_groups][:2] == [22, 22]
    for bpc in BLOCKS_PER_CHUNK:
        planned = _mtp_plan(case, blocks_per_chunk=bpc)
        off = vllm.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": planned.blocks_per_chunk})
        assert planned.tokens_per_hash == off["tokens_per_hash"] == 4
        assert planned.worker_bytes_per_block == off["worker_bytes_per_block"]
        up = planned.upstream
        assert up is not None
        assert (up.row_bytes, up.num_chunks) == (off["row_bytes"], off["num_chunks"])
        assert up.gauge_tokens == off["gauge_tokens"]
        assert [g.tokens_per_block for g in up.groups] == off["group_tokens_per_block"]
        assert [g.window_chunks for g in up.groups] == off["window_chunks"]


def test_the_mtp_stand_in_is_vllm_s_cuda_drafter():
    """Why the fixture above is needed and what it keeps: the CPU export refuses MTP, the
    CUDA drafter's layer is a DeepseekV4DecoderLayer at layers.{num_hidden_layers + i},
    and the shared attention gives such a layer compress ratio 1."""
    import inspect

    import vllm.models.deepseek_v4 as dsv4
    from vllm.models.deepseek_v4 import attention
    from vllm.models.deepseek_v4.nvidia import mtp as cuda

    with pytest.raises(NotImplementedError, match="not implemented on CPU"):
        dsv4.DeepSeekV4MTP(vllm_config=None)
    layer = " ".join(inspect.getsource(cuda.DeepSeekV4MultiTokenPredictorLayer).split())
    assert "self.mtp_block = DeepseekV4DecoderLayer( vllm_config, prefix," in layer
    predictor = " ".join(inspect.getsource(cuda.DeepSeekV4MultiTokenPredictor).split())
    assert "self.mtp_start_layer_idx = config.num_hidden_layers" in predictor
    source = " ".join(inspect.getsource(attention).split())
    assert ("if layer_id < config.num_hidden_layers: layer_type = config.layer_types["
            "layer_id] self.compress_ratio = max(1, config.compress_rates.get(layer_type, "
            "0)) else: self.compress_ratio = 1") in source


def test_mtp_on_deepseek_v41_is_refused_by_both():
    """vLLM's SpeculativeConfig refuses classic MTP on a deepseek_v41 target (its
    checkpoints ship DSpark stages); the planner refuses it with the same reason. The
    V4 fixture does not parse as transformers' DeepseekV41Config, so vLLM's check is
    read from its source rather than run."""
    import inspect

    from vllm.config.speculative import SpeculativeConfig

    reason = "DeepSeek V4.1 has no classic-MTP draft"
    source = " ".join(inspect.getsource(SpeculativeConfig).split())
    assert '== "deepseek_v41" ): raise ValueError( "DeepSeek V4.1 has no classic-MTP' in source
    config = dict(load_frontier(FLASH), model_type="deepseek_v41")
    with pytest.raises(PlanRefused, match=reason):
        make_plan(config, PlanRequest(tensor_parallel_size=8, cpu_memory_bytes=POOL,
                                      offloader="upstream", speculative_method="mtp",
                                      num_speculative_tokens=1))


def test_default_max_model_len_matches_vllm():
    config = load_frontier(FLASH)
    plan = make_plan(
        config, PlanRequest(cpu_memory_bytes=POOL, tensor_parallel_size=8, offloader="upstream")
    )
    assert plan.max_model_len == vllm_default_max_model_len(config)


@pytest.mark.parametrize("case", [Case(FLASH, 8), Case(FLASH, 2, kv_cache_dtype="fp8")], ids=str)
def test_spillway_s_offloader_is_refused_where_its_connector_refuses(
    case: Case, monkeypatch: pytest.MonkeyPatch
):
    """Spillway's connector (the geometry the engine runs) stops on vLLM's packed groups:
    their blocks (64, 256 and 8 tokens) are coarser than the finest group's 4 and hold
    mixed pages, which it cannot re-cut. The plan refuses Spillway's offloader with the
    same reason, and plans vLLM's (the tests above)."""
    from spillway_engine.offloader import geometry as geometry_module
    from spillway_engine.offloader.geometry import (
        SpillwayConfigError,
        build_geometry,
        with_extra_config,
    )

    monkeypatch.setattr(geometry_module, "_uses_shared_region", lambda: True)
    reason = r"group 0 \(.*\) has 64-token blocks, coarser than the finest .* 4"
    with pytest.raises(PlanRefused, match=reason) as refused:
        plan_for(case, offloader="spillway")
    assert "use the upstream offloader" in str(refused.value)
    vllm = built(case)
    extra = {"cpu_bytes_to_use": POOL, "spillway_chunk_tokens": 256}
    with pytest.raises(SpillwayConfigError, match=reason):
        build_geometry(with_extra_config(vllm.vllm_config, extra), vllm.kv_cache_config)


def test_engine_plan_check_passes_an_mtp_plan(cuda_mtp: None):
    """The engine's start-up check reads vLLM's packed groups with the MTP layer's latent
    as the plan has them, and catches a plan made without the drafter."""
    from spillway_engine.launcher import plan_check

    case = MTP_CASES[3]
    plan, vllm = _mtp_plan(case), built(case)
    vllm.offload({"cpu_bytes_to_use": POOL, "blocks_per_chunk": plan.blocks_per_chunk})
    observed = plan_check.observe(vllm.vllm_config, vllm.kv_cache_config)
    assert plan_check.compare(plan, observed) == []
    assert plan_check.compare(plan_for(Case(FLASH, 8)), observed) != []
