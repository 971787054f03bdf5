"""KV layout: expected figures come from vllm-offload.md section 6 and config arithmetic."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway_engine.planner.families import (
    HOW_TO_ASK,
    NOT_YET_MODELLED,
    SUPPORTED_ARCHITECTURES,
    model_shape,
)
from spillway_engine.planner.gpus import UnknownGpu, get_gpu
from spillway_engine.planner.kv_layout import LayoutRequest, compute_layout
from spillway_engine.planner.shape import ModelConfigError, UnsupportedModel
from tests.unit.planner_fixtures import load_frontier, load_model


def layout(name_or_config, gpu="h100", **kw):
    config = load_model(name_or_config) if isinstance(name_or_config, str) else name_or_config
    kw.setdefault("max_model_len", 4096)
    return compute_layout(model_shape(config), get_gpu(gpu), LayoutRequest(**kw))


def summary(lay):
    return [(g.kind, g.num_layers, g.tokens_per_block, g.page_bytes) for g in lay.groups]


def test_dense_llama_70b_tp8():
    lay = layout("llama-3.1-70b-instruct", tensor_parallel_size=8)
    # 1 KV head per rank x (K + V) x 128 x bf16 x 16 tokens
    assert summary(lay) == [("full_attention", 80, 16, 16 * 1 * 2 * 128 * 2)]
    assert lay.tokens_per_hash == 16
    assert lay.worker_bytes_per_block == 80 * 8192
    assert lay.attention_backend == "FLASH_ATTN"


def test_kv_head_replication_when_tp_exceeds_heads():
    lay = layout("llama-3.1-70b-instruct", tensor_parallel_size=16)
    assert lay.kv_heads_per_rank == 1  # 8 heads over 16 ranks: each rank keeps a full head
    assert lay.groups[0].page_bytes == 8192
    assert any("replicated" in n for n in lay.notes)


def test_gemma3_27b_seven_groups():
    lay = layout("gemma-3-27b-it")
    # 52 SWA + 10 full -> group size 10 -> 6 SWA groups (9,9,9,9,8,8) + 1 full
    assert [g.num_layers for g in lay.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert [g.kind for g in lay.groups] == ["sliding_window"] * 6 + ["full_attention"]
    assert {g.page_bytes for g in lay.groups} == {131072}
    assert {g.sliding_window for g in lay.groups[:6]} == {1024}
    assert lay.groups[-1].sliding_window is None
    assert lay.worker_bytes_per_block == 1310720
    assert layout("gemma-3-27b-it", tensor_parallel_size=4).worker_bytes_per_block == 327680
    # layers[i::n] striding, as vLLM assigns them
    assert lay.groups[0].layer_indices[:3] == (0, 7, 14)
    assert lay.groups[-1].layer_indices == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)


def test_gpt_oss_two_groups_with_sinks():
    lay = layout("gpt-oss-120b")
    assert summary(lay) == [("sliding_window", 18, 16, 32768), ("full_attention", 18, 16, 32768)]
    assert lay.groups[0].sliding_window == 128
    assert lay.kv_cache_dtype == "bfloat16"  # no torch_dtype: float32 downcast to bf16
    # SM8x: FA2 has no sinks and FlashInfer takes them only through TRT-LLM's kernels
    # (SM90+), so vLLM falls back to Triton; blocks stay 16 tokens
    assert layout("gpt-oss-120b", gpu="a100").attention_backend == "TRITON_ATTN"
    assert layout("gpt-oss-120b", gpu="rtx-pro-6000").attention_backend == "FLASHINFER"
    assert layout("gpt-oss-120b", gpu="a100").groups[0].tokens_per_block == 16


@pytest.mark.parametrize(
    ("gpu", "tp", "block", "worker_bytes"),
    [
        ("h100", 1, 576, 14_155_776),  # FlashInfer GDN: 64-token checkpoint grid
        ("h200", 4, 320, 3_932_160),
        ("a100", 1, 544, 12 * 544 * 2048),  # Triton GDN: no grid
        ("a100", 4, 272, 12 * 272 * 1024),
    ],
)
def test_qwen3_next_hybrid_alignment(gpu, tp, block, worker_bytes):
    lay = layout("qwen3-next-80b-a3b-instruct", gpu=gpu, tensor_parallel_size=tp)
    assert [g.kind for g in lay.groups] == ["mamba"] * 3 + ["full_attention"]
    assert {g.num_layers for g in lay.groups} == {12}
    assert {g.tokens_per_block for g in lay.groups} == {block}
    assert lay.tokens_per_hash == block
    assert lay.worker_bytes_per_block == worker_bytes
    # the Mamba page is padded up to exactly one attention page
    assert lay.mamba_page_padded_bytes == lay.groups[-1].page_bytes
    assert lay.mamba_page_bytes < lay.mamba_page_padded_bytes


def test_qwen3_next_real_state_size():
    lay = layout("qwen3-next-80b-a3b-instruct")
    conv = (128 * 16 * 2 + 128 * 32) * 3
    recurrent = 32 * 128 * 128
    assert lay.mamba_page_bytes == (conv + recurrent) * 2 == 1_097_728


def test_jamba_mamba1_hybrid():
    lay = layout("jamba-mini-1.5")
    # (2*4096*3 conv + 2*4096*16 ssm) * 2 B = 311296 > 16 tokens * 4096 B -> 80-token blocks
    assert lay.mamba_page_bytes == 311296
    assert lay.block_size == 80
    assert [g.kind for g in lay.groups] == ["mamba"] * 7 + ["full_attention"]
    assert lay.groups[-1].layer_indices == (4, 12, 20, 28)


def test_nemotron_h_fp32_ssm_state():
    lay = layout("nemotron-h-8b-base-8k")
    conv = (128 * 64 + 2 * 8 * 128) * 3 * 2
    ssm = 128 * 64 * 128 * 4  # NemotronH keeps the SSM state in float32
    assert lay.mamba_page_bytes == conv + ssm
    assert lay.block_size == 1040
    assert [g.kind for g in lay.groups].count("full_attention") == 1
    assert sum(g.num_layers for g in lay.groups) == 28


def test_llama4_chunked_local():
    lay = layout("llama-4-scout-17b-16e")
    assert [g.kind for g in lay.groups] == ["chunked_local"] * 3 + ["full_attention"]
    assert {g.attention_chunk_size for g in lay.groups[:3]} == {8192}
    assert lay.groups[-1].layer_indices == tuple(range(3, 48, 4))  # every 4th layer is NoPE
    assert lay.worker_bytes_per_block == 12 * 16 * 8 * 2 * 128 * 2


def test_deepseek_v3_mla():
    lay = layout("deepseek-v3", tensor_parallel_size=8)
    assert summary(lay) == [("mla", 61, 16, 16 * 576 * 2)]
    assert lay.worker_bytes_per_block == 1_124_352
    assert lay.tp_replicas == 8
    assert lay.attention_backend == "FLASH_ATTN_MLA"
    fp8 = layout("deepseek-v3", kv_cache_dtype="fp8")
    assert fp8.attention_backend == "FLASHMLA"
    assert summary(fp8) == [("mla", 61, 64, 64 * 576)]
    assert layout("deepseek-v3", gpu="a100").attention_backend == "TRITON_MLA"


def test_sliding_window_every_layer():
    lay = layout("phi-3-mini-4k-instruct")
    assert summary(lay) == [("sliding_window", 32, 16, 16 * 32 * 2 * 96 * 2)]
    mistral = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
    }
    assert summary(layout(mistral)) == [("sliding_window", 32, 16, 65536)]


def test_qwen2_window_only_with_use_sliding_window():
    lay = layout("qwen2.5-7b-instruct")
    assert summary(lay) == [("full_attention", 28, 16, 16 * 4 * 2 * 128 * 2)]


def test_forced_block_size():
    assert layout("llama-3.2-1b", block_size=32).groups[0].tokens_per_block == 32
    with pytest.raises(UnsupportedModel, match="not supported"):
        layout("llama-3.2-1b", block_size=24)
    # a forced block FlashMLA cannot split steers vLLM's selector to Triton-MLA
    forced = layout("deepseek-v3", block_size=16, kv_cache_dtype="fp8")
    assert (forced.attention_backend, forced.block_size) == ("TRITON_MLA", 16)
    forced = layout("deepseek-v3", block_size=128, kv_cache_dtype="fp8")
    assert (forced.attention_backend, forced.block_size) == ("FLASHMLA", 128)


def test_fp8_kv_cache_halves_pages():
    assert layout("llama-3.2-1b", kv_cache_dtype="fp8").groups[0].page_bytes == 16 * 8 * 2 * 64
    with pytest.raises(UnsupportedModel, match=r"kvCacheDtype.*Invalid kv_cache_dtype: .int4."):
        layout("llama-3.2-1b", kv_cache_dtype="int4")


def test_mamba_without_prefix_caching_hashes_at_lcm():
    lay = layout("qwen3-next-80b-a3b-instruct", enable_prefix_caching=False, max_model_len=8192)
    assert lay.mamba_cache_mode == "none"
    assert lay.groups[0].tokens_per_block == 8192
    assert lay.groups[-1].tokens_per_block == 544  # no FlashInfer checkpoint grid off align mode
    assert lay.tokens_per_hash == math.lcm(544, 8192)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({}, ModelConfigError, "architectures"),
        ({"architectures": "Llama"}, ModelConfigError, "list"),
        ({"architectures": ["FooForCausalLM"]}, UnsupportedModel, "FooForCausalLM"),
        ({"architectures": ["LlamaForCausalLM"]}, ModelConfigError, "num_hidden_layers"),
        (
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": -3},
            ModelConfigError,
            "num_hidden_layers",
        ),
        (
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 2,
                "num_attention_heads": "many",
            },
            ModelConfigError,
            "integer",
        ),
        (
            {"architectures": ["DeepseekV3ForCausalLM"], "index_topk": 2048},
            UnsupportedModel,
            "indexer",
        ),
        ({"architectures": ["NemotronHForCausalLM"]}, ModelConfigError, "hybrid_override_pattern"),
    ],
)
def test_bad_configs(config, error, match):
    with pytest.raises(error, match=match):
        model_shape(config)


def test_unknown_gpu():
    with pytest.raises(UnknownGpu, match=r"unknown GPU 'tpu'; known GPUs: h100, .*b200"):
        get_gpu("tpu")
    assert get_gpu("H200").name == "h200"
    assert get_gpu("NVIDIA_A100-80GB").name == "a100"


@pytest.mark.parametrize(
    ("name", "catalogue"),
    [
        ("b200", "b200"), ("B300", "b300"), ("GB200", "gb200"), ("gb300", "gb300"),
        ("RTX-PRO-6000", "rtx-pro-6000"), ("blackwell", "b200"), ("h20", "h20"), ("L4", "l4"),
        # GPU Feature Discovery's nvidia.com/gpu.product values
        ("NVIDIA-B200", "b200"), ("NVIDIA-H100-80GB-HBM3", "h100"), ("NVIDIA-L4", "l4"),
        ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "rtx-pro-6000"),
        ("NVIDIA-A100-SXM4-40GB", "a100-40gb"),
    ],
)
def test_catalogue_names_and_gfd_labels(name: str, catalogue: str):
    assert get_gpu(name).name == catalogue


def test_catalogue_facts():
    from spillway_engine.planner.gpus import GPUS, NVLINK_C2C, PCIE_GEN5_X16

    caps = {g.name: g.compute_capability for g in GPUS.values()}
    assert caps["b200"] == caps["gb200"] == (10, 0)
    assert caps["b300"] == caps["gb300"] == (10, 3)
    assert caps["rtx-pro-6000"] == (12, 0) and caps["l4"] == (8, 9) and caps["h20"] == (9, 0)
    assert GPUS["gb200"].host_link_bytes_per_s == NVLINK_C2C > 7 * PCIE_GEN5_X16
    labels = [label for g in GPUS.values() for label in g.gfd_products]
    assert len(labels) == len(set(labels)), "a GFD label names one catalogue GPU"
    assert all(g.blackwell == (g.compute_capability[0] >= 10) for g in GPUS.values())


@pytest.mark.parametrize(
    ("gpu", "head_k_dim", "cuda_major", "kernel"),
    [
        ("h100", 128, 12, "flashinfer"), ("h100", 64, 13, "flashinfer"),
        ("b200", 128, 13, "flashinfer"), ("b200", 128, 12, "triton"),
        ("b200", 64, 13, "triton"), ("rtx-pro-6000", 128, 13, "flashinfer"),
        ("a100", 128, 13, "triton"), ("l40s", 128, 13, "triton"),
    ],
)
def test_gdn_prefill_kernel(gpu: str, head_k_dim: int, cuda_major: int, kernel: str):
    assert get_gpu(gpu).gdn_prefill_kernel(head_k_dim, cuda_major) == kernel


def test_pipeline_parallel_with_more_stages_than_layers_refused():
    # pipeline stages are modelled (tests/unit/engine/planner/test_planner_pipeline.py); a stage
    # without a KV-cache layer is refused
    with pytest.raises(UnsupportedModel, match="pipeline_parallel_size 32 exceeds"):
        layout("llama-3.2-1b", pipeline_parallel_size=32)


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 96),
    kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 80, 96, 128, 256]),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    dtype=st.sampled_from(["auto", "fp8", "bfloat16"]),  # float16 with bf16: vLLM refuses
)
def test_dense_property(layers, kv_heads, group, head_dim, tp, dtype):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * group,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "torch_dtype": "bfloat16",
    }
    if (kv_heads * group) % tp or (kv_heads % tp and tp % kv_heads):
        with pytest.raises(UnsupportedModel, match="TP"):
            layout(config, tensor_parallel_size=tp, kv_cache_dtype=dtype)
        return
    lay = layout(config, tensor_parallel_size=tp, kv_cache_dtype=dtype)
    dtype_bytes = 1 if dtype == "fp8" else 2
    assert len(lay.groups) == 1
    assert lay.groups[0].page_bytes == 16 * max(1, kv_heads // tp) * 2 * head_dim * dtype_bytes
    assert lay.worker_bytes_per_block == layers * lay.groups[0].page_bytes
    assert lay.tokens_per_hash == 16


@settings(max_examples=120, deadline=None)
@given(
    layers=st.integers(2, 80),
    window=st.integers(1, 8192),
    pattern=st.integers(2, 8),
    kv_heads=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_swa_full_groups_partition_layers(layers, window, pattern, kv_heads):
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * 2,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "torch_dtype": "bfloat16",
    }
    lay = layout(config)
    members = sorted(i for g in lay.groups for i in g.layer_indices)
    assert members == list(range(layers))  # every layer in exactly one group
    assert len({g.page_bytes for g in lay.groups}) == 1
    sizes = [g.num_layers + g.padded_layers for g in lay.groups]
    assert len(set(sizes)) == 1  # padding evens the groups out
    assert lay.worker_bytes_per_block == max(g.bytes_per_block for g in lay.groups)


@settings(max_examples=120, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 128, 256]),
    k_heads=st.sampled_from([4, 8, 16]),
    v_mult=st.sampled_from([1, 2, 4]),
    k_dim=st.sampled_from([64, 128]),
    tp=st.sampled_from([1, 2, 4]),
    gpu=st.sampled_from(["h100", "a100"]),
)
def test_gdn_hybrid_property(kv_heads, head_dim, k_heads, v_mult, k_dim, tp, gpu):
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": k_heads * v_mult,
        "linear_key_head_dim": k_dim,
        "linear_value_head_dim": k_dim,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    }
    lay = layout(config, gpu=gpu, tensor_parallel_size=tp)
    per_token = max(1, kv_heads // tp) * 2 * head_dim * 2
    grid = 64 if gpu == "h100" else 16
    assert lay.block_size % grid == 0
    assert lay.groups[-1].page_bytes == lay.block_size * per_token
    assert lay.groups[-1].page_bytes >= lay.mamba_page_bytes
    # the smallest grid-aligned block that holds a state
    assert (lay.block_size - grid) * per_token < max(lay.mamba_page_bytes, grid * per_token)


# ------------------------------------------------------------ the 2026 frontier


def test_kimi_linear_kda_states_in_mla_sized_pages():
    # KDA state: q/k/v short convs (3 x 32 heads x 128, kernel 4) in bf16 plus a
    # 32 x 128 x 128 float32 recurrent state; MLA latent 576 x 2 bytes per token
    layout = compute_layout(
        model_shape(load_frontier("kimi-linear-48b-a3b")), get_gpu("h100"), LayoutRequest()
    )
    assert layout.mamba_page_bytes == 3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4
    # the block grows in 128-token steps (MLA hybrids) until an MLA page holds a state
    assert layout.block_size == 1920 and layout.block_size % 128 == 0
    assert [g.kind for g in layout.groups] == ["mamba", "mamba", "mamba", "mla"]
    assert [g.num_layers for g in layout.groups] == [7, 7, 6, 7]
    assert {g.page_bytes for g in layout.groups} == {1920 * 576 * 2}


def test_granite_hybrid_mamba2_state_from_transformers_defaults():
    layout = compute_layout(
        model_shape(load_frontier("granite-4.0-h-small")),
        get_gpu("h100"),
        LayoutRequest(tensor_parallel_size=2),
    )
    inner = 2 * 4096  # mamba_expand x hidden; 128 heads of 64, 1 group grown to 2 for TP 2
    conv = (inner + 2 * 2 * 128) // 2 * 3 * 2
    ssm = 64 * 64 * 128 * 2
    assert layout.mamba_page_bytes == conv + ssm
    assert [g.kind for g in layout.groups].count("full_attention") == 1


def test_qwen35_takes_the_ssm_dtype_from_its_config():
    shape = model_shape(load_frontier("qwen3.5-35b-a3b"))
    state = shape.mamba.states(1, "bfloat16", 0)
    assert state[1] == (32 * 128 * 128, "float32")
    assert state[0][1] == "bfloat16"


def test_gemma4_on_hopper_runs_fa4_and_on_ampere_triton():
    shape = model_shape(load_frontier("gemma-4-31b"))
    hopper = compute_layout(shape, get_gpu("h200"), LayoutRequest())
    assert hopper.attention_backend == "FLASH_ATTN"  # FA4 forced, 16-token pages on SM90
    # FP8: FA4's fixed 64-token pages on the head-512 layers make 64 the block
    fp8 = compute_layout(shape, get_gpu("h200"), LayoutRequest(kv_cache_dtype="fp8"))
    assert (fp8.attention_backend, fp8.block_size) == ("FLASH_ATTN", 64)
    assert {g.tokens_per_block for g in fp8.groups if g.kind == "full_attention"} == {128}
    with pytest.raises(UnsupportedModel, match="selector falls back"):
        compute_layout(shape, get_gpu("h200"), LayoutRequest(kv_cache_dtype="fp8", block_size=32))
    layout = compute_layout(shape, get_gpu("a100"), LayoutRequest())
    assert [g.groups for g in (hopper,)] == [layout.groups]  # same MultipleOf(16) rule
    assert layout.attention_backend == "TRITON_ATTN"
    full = [g for g in layout.groups if g.kind == "full_attention"]
    assert [g.tokens_per_block for g in full] == [32]  # 4 kv x 512 pages doubled to match


def test_gemma4_kv_shared_layers_own_no_cache():
    shape = model_shape(load_frontier("gemma-4-e2b"))
    assert len(shape.layers) == 35 - 20


@pytest.mark.parametrize("arch", sorted(NOT_YET_MODELLED))
def test_known_unmodelled_architectures_say_why_and_how_to_ask(arch):
    with pytest.raises(UnsupportedModel) as refused:
        model_shape({"architectures": [arch], "num_hidden_layers": 2})
    message = str(refused.value)
    assert NOT_YET_MODELLED[arch] in message
    assert HOW_TO_ASK in message
    assert "Qwen3_5MoeForCausalLM" in message  # the supported list


def test_plan_help_lists_every_supported_architecture(capsys):
    from spillway_cli.main import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in text
    assert "To ask for one, open an issue" in text


def test_plan_cli_takes_a_speculative_config(capsys):
    import json

    from spillway_cli.main import main
    from tests.unit.planner_fixtures import FRONTIER

    args = ["plan", "--model-config", str(FRONTIER / "qwen3.5-35b-a3b.json")]
    args += ["--cpu-memory", "8Gi", "--format", "json", "--max-model-len", "4096"]
    assert (
        main([*args, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["speculative_method"] == "mtp"
    assert plan["draft_layer_indices"] == [40]
    ngram = '{"method": "ngram", "num_speculative_tokens": 1}'
    assert main([*args, "--speculative-config", ngram]) == 2
    assert "not modelled" in json.loads(capsys.readouterr().out)["error"]  # --format json


def test_plan_names_the_backend_of_every_group():
    from spillway_engine.planner.plan import PlanRequest, make_plan
    from tests.unit.planner_fixtures import load_model

    plan = make_plan(load_model("qwen3-next-80b-a3b-instruct"),
                     PlanRequest(gpu="b200", cpu_memory_bytes=64 << 30))
    assert {(g.kind, g.backend) for g in plan.kv_groups} == {
        ("full_attention", "FLASHINFER"), ("mamba", "gdn (flashinfer prefill)")}
    cu12 = make_plan(load_model("qwen3-next-80b-a3b-instruct"),
                     PlanRequest(gpu="b200", cuda_major=12, cpu_memory_bytes=64 << 30))
    assert {g.backend for g in cu12.kv_groups if g.kind == "mamba"} == {"gdn (triton prefill)"}
    hopper = make_plan(load_model("deepseek-v3"),
                       PlanRequest(gpu="h100", tensor_parallel_size=8, cpu_memory_bytes=64 << 30))
    assert [g.backend for g in hopper.kv_groups] == ["FLASH_ATTN_MLA"]
