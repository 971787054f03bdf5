"""Run vLLM 0.33.0's own KV planning for a config.json on the CPU (no GPU, no weights).

Route (the planned GPU's, without one): build the real model class on the meta
device, tell each attention layer it runs the backend the planner says vLLM picks on
the GPU (the kernels decide block sizes), run the base ``Platform`` block-size hook
(``CudaPlatform`` does not override it), collect the layers' specs as the GPU worker
does, then call ``get_global_kv_cache_groups``, ``get_kv_cache_configs``,
``build_offloading_config`` and ``CPUOffloadingSpec``.

Two CPU-only differences are undone, both documented in the contract README:
* TP > 1 without N processes: the TP group reports N ranks while the model is built,
  so every layer sizes its shards as rank 0 of N would (shapes only, no collectives).
* The CUDA-only bits: the FlashInfer GDN kernel's 64-token checkpoint grid on Hopper,
  the GDN SSM dtype CpuPlatform resets to float32, the forced --block-size CpuPlatform
  overrides for its MLA kernel, and the shared /dev/shm region that makes replicated
  MLA store one copy (``_uses_shared_region`` is CUDA-only).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import vllm
from vllm.config import (
    KVTransferConfig,
    ModelConfig,
    get_layers_from_vllm_config,
    set_current_vllm_config,
)
from vllm.config.utils import replace as vllm_replace
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
    parallel_state,
)
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import get_model_architecture, initialize_model
from vllm.platforms import current_platform
from vllm.platforms.interface import Platform
from vllm.utils.network_utils import get_open_port
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

# The layers' planned-GPU backends and spec rule, shared with the emulated GPU worker.
from spillway_engine.emulator.backends import (
    FlashMLAStandIn,
    construct_backend_path,
    give_planned_backends,
    layer_kv_cache_specs,
)
from spillway_engine.emulator.worker import cuda_streams_stood_in

VLLM_VERSION = vllm.__version__
__all__ = [
    "VLLM_VERSION",
    "Case",
    "FlashMLAStandIn",
    "VllmLayout",
    "build_layout",
    "kernel_block_sizes",
]


@dataclass(frozen=True)
class Case:
    """One engine configuration to plan with vLLM."""

    model: str
    tensor_parallel_size: int = 1
    gpu: str = "h100"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    block_size: int | None = None
    dtype: str = "auto"
    #: GPU KV blocks (vLLM's num_gpu_blocks_override); None: effectively unlimited
    num_gpu_blocks: int | None = None
    #: --speculative-config method ("mtp", "draft_model", "eagle3") and tokens per step;
    #: None: no drafter
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    #: fixture name of the drafter's config.json (draft model or EAGLE head), for the record
    draft_model: str | None = None
    #: the engine image's CUDA runtime major (Blackwell's GDN prefill kernel needs 13)
    cuda_major: int = 13

    def __str__(self) -> str:
        extra = "" if self.kv_cache_dtype == "auto" else f"-{self.kv_cache_dtype}"
        extra += "" if self.enable_prefix_caching else "-nopc"
        extra += "" if self.block_size is None else f"-bs{self.block_size}"
        extra += "" if self.dtype == "auto" else f"-{self.dtype}"
        if self.speculative_method:
            extra += f"-{self.speculative_method}{self.num_speculative_tokens}"
        if self.draft_model:
            extra += f"-{self.draft_model}"
        extra += "" if self.cuda_major == 13 else f"-cuda{self.cuda_major}"
        return f"{self.model}-tp{self.tensor_parallel_size}-{self.gpu}{extra}"


@dataclass
class VllmLayout:
    """What vLLM built for one case; ``offload`` plans a bpc on top of it."""

    vllm_config: Any
    kv_cache_config: Any
    layer_names: list[str]
    groups: list[dict[str, Any]]
    block_size: int
    #: the attention backend vLLM's CUDA selector picks on the case's GPU for each
    #: distinct selector config the layers asked with (``tests/contract/cuda_selector``)
    cuda_selected: tuple[str, ...] = ()

    def offload(self, extra: dict[str, Any]) -> dict[str, Any]:
        """build_offloading_config + CPUOffloadingSpec for one kv_connector_extra_config."""
        transfer = self.vllm_config.kv_transfer_config
        transfer.kv_connector_extra_config = dict(extra)
        off = build_offloading_config(self.vllm_config, self.kv_cache_config)
        spec = OffloadingSpecFactory.create_spec(off)
        return {
            "tokens_per_hash": off.cache.tokens_per_hash,
            "blocks_per_chunk": off.cache.blocks_per_chunk,
            "worker_bytes_per_block": off.worker_kv_bytes_per_block,
            "replicated_layout": off.replicated_layout,
            "row_bytes": spec.kv_bytes_per_chunk,
            "num_chunks": spec.num_chunks,
            "gauge_tokens": spec.cpu_info.cpu_kv_cache_size_tokens,
            "group_tokens_per_block": [g.tokens_per_block for g in off.groups],
            "window_chunks": [g.sliding_window_size_in_chunks for g in off.groups],
        }


def _kind(spec: Any) -> str:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return "uniform:" + _kind(next(iter(spec.kv_cache_specs.values())))
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local"
    if isinstance(spec, FullAttentionSpec):
        return "full_attention"
    return type(spec).__name__


def _uses_shared_region_on_cuda(self: CPUOffloadingSpec) -> bool:
    return True


CPUOffloadingSpec._uses_shared_region = _uses_shared_region_on_cuda  # type: ignore[method-assign]

_distributed_ready = False
_construct_backend_path: str | None = None
_cpu_attn_backend_cls = type(current_platform).get_attn_backend_cls
#: every (selector config, heads) the model's layers asked the platform for while built
_asked: list[tuple[Any, Any]] = []


def _attn_backend_cls(
    cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None
) -> str:
    _asked.append((attn_selector_config, num_heads))
    # CPU backends refuse an FP8 KV cache at construction; the GPU ones take it.
    if _construct_backend_path is not None:
        return _construct_backend_path
    return _cpu_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


type(current_platform).get_attn_backend_cls = classmethod(_attn_backend_cls)  # type: ignore

_cpu_check_and_update_config = type(current_platform).check_and_update_config


def _check_and_update_config_as_on_cuda(cls: Any, vllm_config: Any) -> None:
    # CpuPlatform turns prefix caching and chunked prefill off for MLA models (its MLA
    # kernel lacks them; MLA+Mamba hybrids such as Kimi-Linear then fail VllmConfig's
    # mamba_block_size check) and may reset the SSM state dtype to float32 for its
    # accelerated GDN kernel, depending on the CPU. CUDA keeps all three as set.
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    prefix, chunked = cache.enable_prefix_caching, scheduler.enable_chunked_prefill
    ssm_dtype = cache.mamba_ssm_cache_dtype
    _cpu_check_and_update_config(vllm_config)
    cache.mamba_ssm_cache_dtype = ssm_dtype
    if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
        cache.enable_prefix_caching, scheduler.enable_chunked_prefill = prefix, chunked


type(current_platform).check_and_update_config = classmethod(  # type: ignore[method-assign]
    _check_and_update_config_as_on_cuda
)


def _init_distributed() -> None:
    global _distributed_ready
    if not _distributed_ready:
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        )
        _distributed_ready = True


def _build_drafter(vc: Any) -> None:
    """The proposer's ``load_model`` on the meta device: the drafter joins the target's
    forward context and its new attention layers are marked as draft layers."""
    target = set(get_layers_from_vllm_config(vc, AttentionLayerBase))
    spec = vc.speculative_config
    with torch.device("meta"), cuda_streams_stood_in():
        if spec.method == "draft_model":
            # DraftModelProposer._create_draft_vllm_config / _get_model: the draft's own
            # model and parallel config, unquantised, under the "draft_model" prefix
            draft_vc = vllm_replace(
                vc,
                quant_config=None,
                parallel_config=vllm_replace(
                    spec.draft_parallel_config, rank=vc.parallel_config.rank
                ),
                model_config=spec.draft_model_config,
            )
            initialize_model(draft_vc, prefix="draft_model")
        else:
            initialize_model(vc, model_config=spec.draft_model_config)
    layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
    for name in set(layers) - target:
        layers[name].is_draft_layer = True


def _write_config(config: dict[str, Any]) -> str:
    config = dict(config)
    # Weight quantisation does not touch the KV cache, and its kernels need CUDA.
    config.pop("quantization_config", None)
    if config.get("model_type") == "gpt_oss":
        # The MLP width is KV-irrelevant; the CPU MoE kernels reject 2880 / TP shards.
        config["intermediate_size"] = 3072
    model_dir = tempfile.mkdtemp(prefix="spillway-contract-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return model_dir


def vllm_default_max_model_len(config: dict[str, Any]) -> int:
    """The max_model_len vLLM derives when none is given."""
    return ModelConfig(model=_write_config(config), skip_tokenizer_init=True).max_model_len


def build_layout(
    config: dict[str, Any],
    case: Case,
    attention_backend: str | None,
    draft_config: dict[str, Any] | None = None,
) -> VllmLayout:
    """Plan ``config`` with vLLM for ``case``; raises whatever vLLM raises.

    ``draft_config``: the config.json of a separate drafter (a draft model or an EAGLE
    head), passed to vLLM as the speculative config's ``model``."""
    model_dir = _write_config(config)
    speculative: dict[str, Any] | None = None
    if case.speculative_method is not None:
        speculative = {
            "method": case.speculative_method,
            "num_speculative_tokens": case.num_speculative_tokens,
        }
        if draft_config is not None:
            speculative["model"] = _write_config(draft_config)
    # EngineArgs, as `vllm serve` builds the config (it sets CacheConfig.sliding_window
    # for all-sliding models, prefix caching defaults, mamba cache mode...).
    vc = EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=case.max_model_len,
        enforce_eager=True,
        tensor_parallel_size=case.tensor_parallel_size,
        dtype=case.dtype,
        kv_cache_dtype=case.kv_cache_dtype,
        enable_prefix_caching=case.enable_prefix_caching,
        block_size=case.block_size,
        speculative_config=speculative,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30},
        ),
    ).create_engine_config()
    if case.block_size is not None:
        vc.cache_config.block_size = case.block_size  # CpuPlatform forces 16 for CPU MLA
    vc.cache_config.num_gpu_blocks_override = case.num_gpu_blocks
    if vc.model_config.hf_text_config.model_type == "qwen3_next":
        vc.cache_config.mamba_ssm_cache_dtype = "auto"  # undo CpuPlatform's float32 reset

    global _construct_backend_path
    _construct_backend_path = construct_backend_path(attention_backend, case.kv_cache_dtype)
    with set_current_vllm_config(vc):
        _init_distributed()
        parallel_state.destroy_model_parallel()
        initialize_model_parallel(1, 1)  # inside the config: MoE models need the EP group
        tp_group = parallel_state.get_tp_group()
        tp_group.world_size = case.tensor_parallel_size
        tp_group.rank_in_group = 0
        model_cls, _ = get_model_architecture(vc.model_config)
        _asked.clear()
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()  # ask the platform for every layer kind
        with torch.device("meta"), cuda_streams_stood_in():
            model_cls(vllm_config=vc, prefix="")
        if vc.speculative_config is not None:
            _build_drafter(vc)
        cuda_selected = _select_on_cuda(case.gpu, vc)
        layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
        give_planned_backends(
            layers, attention_backend, case.gpu, case.enable_prefix_caching,
            gdn_kernel_on(case.gpu, config, case.cuda_major),
        )
        Platform.update_block_size_for_backend(vc)
        specs = layer_kv_cache_specs(vc, layers)

    register_all_kvcache_specs(vc)
    # The worker's rule (get_supported_kv_cache_layouts over the layers' backends): the
    # default preference unless a backend declares layouts (DeepSeek-V4's indexer:
    # block-outermost only, which overrides the offloading connector's LBHNC).
    layouts = get_supported_kv_cache_layouts(get_current_attn_backends(vc))
    resolve_kv_cache_layout(vc, [[p.name for p in layouts]], specs.values())
    groups = get_global_kv_cache_groups(vc, [specs])
    kv_cfg = get_kv_cache_configs(vc, [specs], [1 << 40], groups)[0]
    names = list(specs)
    described = []
    for g in kv_cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        described.append(
            {
                "kind": _kind(spec),
                "layer_indices": [names.index(n) for n in g.layer_names],
                "tokens_per_block": spec.block_size,
                "page_bytes": spec.page_size_bytes,
                "sliding_window": getattr(spec, "sliding_window", None),
            }
        )
    return VllmLayout(vc, kv_cfg, names, described, vc.cache_config.block_size, cuda_selected)


_selector: Any = None


def _select_on_cuda(gpu: str, vc: Any) -> tuple[str, ...]:
    """vLLM's CUDA selection on ``gpu`` for each selector config the layers asked with,
    in a process of its own (``cuda_selector`` stands in for CUDA libraries there); a
    refusal is returned as text."""
    import concurrent.futures
    import importlib
    import multiprocessing

    from spillway_engine.planner.gpus import get_gpu

    global _selector
    if _selector is None:
        # the worker imports the selector first: its stand-ins must precede vLLM's imports
        _selector = concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=importlib.import_module,
            initargs=("tests.contract.cuda_selector",),
        )
    # vLLM's loader builds the model under the model's dtype (set_default_torch_dtype),
    # which the layers ask with; here it is built under the CPU's default
    dtype = None if vc is None else vc.model_config.dtype
    if vc is None:
        return ()
    asked = list(dict.fromkeys(
        (c._replace(dtype=dtype, use_kv_connector=True), h) for c, h in _asked
    ))
    capability = get_gpu(gpu).compute_capability
    names = _selector.submit(_select_names, capability, asked).result(timeout=600)
    return tuple(dict.fromkeys(names))


def gdn_kernel_on(gpu: str, config: dict[str, Any], cuda_major: int = 13) -> str | None:
    """vLLM's GDN prefill kernel on ``gpu`` for a GDN model's config (None without GDN
    layers), asked of vLLM's own rule in the selector's process."""
    if "linear_key_head_dim" not in config or "linear_num_key_heads" not in config:
        return None
    _select_on_cuda(gpu, None)  # starts the worker
    from spillway_engine.planner.gpus import get_gpu

    return _selector.submit(
        _gdn_kernel, get_gpu(gpu).compute_capability, int(config["linear_key_head_dim"]),
        int(config.get("linear_value_head_dim", config["linear_key_head_dim"])), cuda_major,
    ).result(timeout=600)


def _gdn_kernel(*args: Any) -> str:
    from tests.contract.cuda_selector import gdn_prefill_kernel

    return gdn_prefill_kernel(*args)


def _select_names(capability: tuple[int, int], asked: list[tuple[Any, Any]]) -> list[str]:
    from tests.contract.cuda_selector import select_names

    return select_names(capability, asked)


def kernel_block_sizes(built: VllmLayout) -> list[int]:
    """Each group's kernel block size as the GPU worker picks it when it binds the KV
    cache (``GPUModelRunner.initialize_attn_backend``'s attention groups, then vLLM's
    ``prepare_kernel_block_sizes``); raises where the worker would (a backend with a
    fixed kernel page that does not divide the group's block)."""
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    layers = get_layers_from_vllm_config(built.vllm_config, AttentionLayerBase)
    attn_groups = []
    for gid, group in enumerate(built.kv_cache_config.kv_cache_groups):
        by_key: dict[tuple[Any, Any], list[str]] = {}
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            by_key.setdefault((layers[name].get_attn_backend(), spec), []).append(name)
        attn_groups.append(
            [AttentionGroup(backend, names, spec, gid) for (backend, spec), names in by_key.items()]
        )
    return prepare_kernel_block_sizes(built.kv_cache_config, attn_groups)


def cuda_selections(config: dict[str, Any], case: Case, gpus: list[str]) -> dict[str, Any]:
    """vLLM's CUDA selection for ``case`` on each of ``gpus`` (no KV planning): the model
    is built as vLLM builds it with the case's --kv-cache-dtype, and every selector
    config its layers ask with is selected on each GPU's capability. Per GPU: the names
    picked, with ``refused: ...`` for a selector config no backend takes. Raises what
    vLLM raises before selecting (its config checks)."""
    vc = EngineArgs(
        model=_write_config(config), skip_tokenizer_init=True, max_model_len=case.max_model_len,
        enforce_eager=True, tensor_parallel_size=case.tensor_parallel_size,
        kv_cache_dtype=case.kv_cache_dtype,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30},
        ),
    ).create_engine_config()
    global _construct_backend_path
    # an MLA layer needs an MLA backend to be constructed; the rest take Triton (any KV)
    mla = "TRITON_MLA" if vc.model_config.use_mla else None
    _construct_backend_path = construct_backend_path(mla, case.kv_cache_dtype)
    with set_current_vllm_config(vc):
        _init_distributed()
        parallel_state.destroy_model_parallel()
        initialize_model_parallel(1, 1)
        tp_group = parallel_state.get_tp_group()
        tp_group.world_size = case.tensor_parallel_size
        tp_group.rank_in_group = 0
        model_cls, _ = get_model_architecture(vc.model_config)
        _asked.clear()
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
        with torch.device("meta"), cuda_streams_stood_in():
            model_cls(vllm_config=vc, prefix="")
        from spillway_engine.planner.gpus import get_gpu

        by_capability: dict[tuple[int, int], tuple[str, ...]] = {}
        for gpu in gpus:
            cap = get_gpu(gpu).compute_capability
            if cap not in by_capability:
                by_capability[cap] = _select_on_cuda(gpu, vc)
        return {gpu: by_capability[get_gpu(gpu).compute_capability] for gpu in gpus}
