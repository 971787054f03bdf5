"""KV-cache layout: the KV-cache groups vLLM 0.33.0 builds for a model. THE one place.

From a Hugging Face ``config.json`` dict and the deployment (parallelism, dtypes, GPU,
prefix caching) this computes what vLLM's engine core computes at start-up with the
OffloadingConnector on (layer-outer ``LBHNC`` layout, hybrid KV cache manager on):

1. per-layer cache specs on one rank (``Attention``/``MLAAttention``/``MambaBase``
   ``get_kv_cache_spec``), with KV heads split over TP and replicated when TP exceeds
   them (``ModelConfig.get_num_kv_heads``: ``max(1, kv_heads // tp)``);
2. the block size (``Platform.update_block_size_for_backend``): the kernels' preferred
   size, then for attention+Mamba hybrids ``_align_hybrid_block_size`` (block raised
   until an attention page holds a Mamba state, Mamba page padded to match);
3. the groups (``kv_cache_planning.get_kv_cache_groups``): one group when every layer
   has the same spec, else page unification and buckets cut into ``group_size`` layers
   assigned ``layers[i::n]``;
4. the backing allocation's bytes per block per rank (the largest group) and
   ``tokens_per_hash`` (``resolve_kv_cache_block_sizes``).

It never imports vLLM; ``tests/contract`` checks it against vLLM's own code.
Unsupported architectures raise :class:`UnsupportedModel` naming what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from spillway_engine.planner.gpus import Backend, Gpu

Kind = Literal["full_attention", "sliding_window", "chunked_local", "mla", "mamba"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
_TORCH_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


class ModelConfigError(ValueError):
    """The config.json is malformed or misses a field the layout needs."""


class UnsupportedModel(ValueError):
    """vLLM may run this model, but Spillway does not reproduce its KV layout."""


# --------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class LayerKind:
    """What one cache-holding layer stores, in module order."""

    kind: Kind
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class MambaState:
    """A Mamba/GDN state: ``(elements, dtype)`` per tensor, as a function of (TP, dtype)."""

    family: str
    states: Callable[[int, str], list[tuple[int, str]]]

    def page_bytes(self, tp: int, dtype: str) -> int:
        return sum(n * DTYPE_BYTES[dt] for n, dt in self.states(tp, dtype))


@dataclass(frozen=True)
class ModelShape:
    """The facts of a config.json that decide the KV layout."""

    architecture: str
    model_type: str
    dtype: str
    layers: tuple[LayerKind, ...]
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    head_size_v: int = 0
    mla_latent: int = 0
    mamba: MambaState | None = None
    gdn: bool = False
    sinks: bool = False
    mm_prefix: bool = False
    derived_max_model_len: int = 2048
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------------- config access

_MISSING = object()


class _Cfg:
    """Typed reads from a config.json dict with clear errors."""

    def __init__(self, data: dict[str, Any], where: str = "config.json") -> None:
        self.data = data
        self.where = where

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelConfigError(f"{self.where}: missing {key!r}")
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ModelConfigError(f"{self.where}: {key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise ModelConfigError(f"{self.where}: {key!r} must be >= {minimum}, got {value}")
        return value

    def str_list(self, key: str, length: int) -> list[str] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelConfigError(f"{self.where}: {key!r} must be a list of strings")
        if len(value) < length:
            raise ModelConfigError(
                f"{self.where}: {key!r} has {len(value)} entries for {length} layers"
            )
        return value[:length]


def _model_dtype(config: dict[str, Any], text: dict[str, Any]) -> str:
    """vLLM's ``dtype="auto"`` on CUDA: the checkpoint's dtype, float32 downcast to bf16."""
    raw = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    raw = raw or config.get("dtype") or "float32"  # transformers' default when absent
    name = _TORCH_DTYPE_NAMES.get(str(raw).removeprefix("torch.").lower())
    if name is None:
        raise ModelConfigError(f"config.json: unknown torch_dtype {raw!r}")
    return "bfloat16" if name == "float32" else name


def _text_config(config: dict[str, Any], defaults: dict[str, Any]) -> _Cfg:
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ModelConfigError("config.json: 'text_config' must be an object")
    merged = dict(defaults)
    merged.update({k: v for k, v in (text or config).items() if v is not None})
    return _Cfg(merged, "config.json text_config" if text else "config.json")


def _attention_heads(cfg: _Cfg) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) like ``ModelConfig``: ``head_dim`` or hidden/heads."""
    heads = cfg.int("num_attention_heads")
    kv_heads = cfg.int("num_key_value_heads", heads)
    if cfg.has("head_dim"):
        head = cfg.int("head_dim")
    else:
        hidden = cfg.int("hidden_size")
        if hidden % heads:
            raise ModelConfigError(
                f"{cfg.where}: hidden_size {hidden} is not divisible by "
                f"num_attention_heads {heads} and no head_dim is given"
            )
        head = hidden // heads
    return heads, kv_heads, head


_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length.
_ROPE_ALREADY_SCALED = (
    "su",
    "longrope",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "deepseek_llama_scaling",
)


def _derived_max_len(cfg: _Cfg) -> int:
    """vLLM's derived max_model_len: the smallest length key, times the RoPE factor."""
    lengths = [cfg.int(k) for k in _MAX_LEN_KEYS if cfg.has(k)]
    length = cfg.int("model_max_length") if cfg.has("model_max_length") else min(lengths or [2048])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(cfg.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in _ROPE_ALREADY_SCALED and kind != "default":
            factor = rope.get("factor") or 1.0
            if not isinstance(factor, int | float):
                raise ModelConfigError(f"{cfg.where}: rope factor {factor!r} is not a number")
            length = int(length * factor)
    return length


def _window(cfg: _Cfg, key: str = "sliding_window") -> int | None:
    if not cfg.has(key):
        return None
    value = cfg.int(key, minimum=0)
    return value or None  # vLLM treats 0 as "no sliding window"


# ----------------------------------------------------------------------- architectures


def _dense(config: dict[str, Any], arch: str) -> ModelShape:
    """Llama-style decoders (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``phi3``...)."""
    cfg = _text_config(config, {})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    model_type = str(cfg.get("model_type", ""))
    window = _window(cfg)
    notes: list[str] = []
    layer_types = cfg.str_list("layer_types", n)
    if model_type.startswith(("qwen2", "qwen3")):
        if not cfg.get("use_sliding_window", False):
            window = None  # transformers drops the window unless use_sliding_window is set
        if layer_types is None:  # transformers' derivation
            first = cfg.int("max_window_layers", 28, minimum=0)
            layer_types = [
                "sliding_attention" if window and i >= first else "full_attention" for i in range(n)
            ]
        if len(set(layer_types)) > 1:
            raise UnsupportedModel(
                f"{arch} with a sliding window on only some layers (max_window_layers < "
                "num_hidden_layers) is rejected by vLLM 0.33.0"
            )
    layers: list[LayerKind] = []
    for i in range(n):
        # llama.py: "sliding_attention" layers take config.sliding_window; other layers
        # fall back to CacheConfig.sliding_window, which EngineArgs only sets when there
        # are no layer_types or all of them slide.
        if layer_types is None:
            sliding = window
        elif layer_types[i] in ("sliding_attention", "full_attention"):
            sliding = window if layer_types[i] == "sliding_attention" else None
        else:
            raise UnsupportedModel(f"{arch}: layer type {layer_types[i]!r} is not modelled")
        layers.append(
            LayerKind("sliding_window", sliding) if sliding else LayerKind("full_attention")
        )
    if window and all(layer.kind == "sliding_window" for layer in layers):
        notes.append(f"sliding window {window} on every layer (config sliding_window)")
    return ModelShape(
        architecture=arch,
        model_type=model_type,
        dtype=_model_dtype(config, cfg.data),
        layers=tuple(layers),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        derived_max_model_len=_derived_max_len(cfg),
        notes=tuple(notes),
    )


_GEMMA2_DEFAULTS = {"sliding_window": 4096, "head_dim": 256, "num_key_value_heads": 8}
_GEMMA3_DEFAULTS = {
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "head_dim": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 26,
    "max_position_embeddings": 131072,
}


def _gemma(config: dict[str, Any], arch: str) -> ModelShape:
    """Gemma 2/3: interleaved sliding-window and full layers (``gemma2.py``, ``gemma3.py``)."""
    gemma3 = arch.startswith("Gemma3")
    cfg = _text_config(config, _GEMMA3_DEFAULTS if gemma3 else _GEMMA2_DEFAULTS)
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    window = _window(cfg)
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:
        # transformers' derivation: every pattern-th layer is global.
        pattern = cfg.int("sliding_window_pattern", 6) if gemma3 else 2
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
    layers = tuple(
        LayerKind("sliding_window", window)
        if t == "sliding_attention" and window
        else LayerKind("full_attention")
        for t in layer_types
    )
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=_model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        # Gemma 3 with a vision tower is a prefix-LM: vLLM picks a composite backend.
        mm_prefix=arch == "Gemma3ForConditionalGeneration",
        derived_max_model_len=_derived_max_len(cfg),
    )


def _gpt_oss(config: dict[str, Any], arch: str) -> ModelShape:
    """gpt-oss: even layers slide (``gpt_oss.py`` ignores layer_types), all have sinks."""
    cfg = _text_config(config, {"sliding_window": 128, "head_dim": 64})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    window = _window(cfg)
    layers = tuple(
        LayerKind("sliding_window", window)
        if i % 2 == 0 and window
        else LayerKind("full_attention")
        for i in range(n)
    )
    return ModelShape(
        architecture=arch,
        model_type="gpt_oss",
        dtype=_model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        sinks=True,
        derived_max_model_len=_derived_max_len(cfg),
    )


def _llama4(config: dict[str, Any], arch: str) -> ModelShape:
    """Llama 4: chunked local attention, with a global NoPE layer every interval-th layer."""
    cfg = _text_config(config, {"no_rope_layer_interval": 4, "attention_chunk_size": 8192})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    chunk = cfg.int("attention_chunk_size")
    rope = cfg.get("no_rope_layers") or None  # transformers treats [] as "derive it"
    if rope is None:
        interval = cfg.int("no_rope_layer_interval")
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(rope, list) or len(rope) < n:
        raise ModelConfigError(f"{cfg.where}: 'no_rope_layers' needs one entry per layer")
    # llama4.py: RoPE layers are chunked-local, NoPE layers (0) are global
    layers = tuple(
        LayerKind("chunked_local", attention_chunk_size=chunk)
        if rope[i]
        else LayerKind("full_attention")
        for i in range(n)
    )
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=_model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        derived_max_model_len=_derived_max_len(cfg),
    )


def _deepseek_mla(config: dict[str, Any], arch: str) -> ModelShape:
    """DeepSeek-V2/V3 and Kimi-K2: MLA, one latent of kv_lora_rank + rope dims per token."""
    cfg = _text_config(config, {})
    if cfg.has("index_topk"):
        raise UnsupportedModel(
            f"{arch} with a sparse-attention indexer (index_topk) is not modelled: the "
            "indexer cache forms a UniformType group Spillway does not reproduce"
        )
    if not cfg.has("kv_lora_rank"):
        raise UnsupportedModel(f"{arch} without kv_lora_rank (non-MLA DeepSeek) is not modelled")
    n = cfg.int("num_hidden_layers")
    latent = cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=_model_dtype(config, cfg.data),
        layers=tuple(LayerKind("mla") for _ in range(n)),
        num_attention_heads=cfg.int("num_attention_heads"),
        num_kv_heads=1,
        head_size=latent,
        head_size_v=0,
        mla_latent=latent,
        derived_max_model_len=_derived_max_len(cfg),
        notes=("MTP draft layers ignored (no speculative decoding)",)
        if cfg.get("num_nextn_predict_layers")
        else (),
    )


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise UnsupportedModel(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size "
            f"({denominator}); vLLM refuses this split"
        )
    return numerator // denominator


def _qwen3_next(config: dict[str, Any], arch: str) -> ModelShape:
    """Qwen3-Next: gated-delta-net (GDN) layers + full attention every interval-th layer."""
    cfg = _text_config(config, {"full_attention_interval": 4, "head_dim": 256})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    layer_types = cfg.str_list("layer_types", n)
    if layer_types is None:
        interval = cfg.int("full_attention_interval")
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    layers = []
    for t in layer_types:
        if t not in ("full_attention", "linear_attention"):
            raise UnsupportedModel(f"{arch}: layer type {t!r} is not modelled")
        layers.append(LayerKind("full_attention" if t == "full_attention" else "mamba"))
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_dim, v_dim = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    kernel = cfg.int("linear_conv_kernel_dim")
    dtype = _model_dtype(config, cfg.data)

    def states(tp: int, dtype: str) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.gated_delta_net_state_shape (no speculative tokens)
        conv_dim = _divide(k_dim * k_heads * 2 + v_dim * v_heads, tp, "GDN conv dim")
        return [
            (conv_dim * (kernel - 1), dtype),
            (_divide(v_heads, tp, "linear_num_value_heads") * v_dim * k_dim, dtype),
        ]

    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        dtype=dtype,
        layers=tuple(layers),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        mamba=MambaState("gdn", states),
        gdn=True,
        derived_max_model_len=_derived_max_len(cfg),
    )


def _jamba(config: dict[str, Any], arch: str) -> ModelShape:
    """Jamba: Mamba-1 layers with attention every ``attn_layer_period``-th layer."""
    cfg = _text_config(config, {"attn_layer_period": 8, "attn_layer_offset": 4})
    n = cfg.int("num_hidden_layers")
    heads, kv_heads, head = _attention_heads(cfg)
    period, offset = cfg.int("attn_layer_period"), cfg.int("attn_layer_offset", minimum=0)
    layers = tuple(
        LayerKind("full_attention") if i % period == offset else LayerKind("mamba")
        for i in range(n)
    )
    inner = cfg.int("mamba_expand", 2) * cfg.int("hidden_size")
    d_state, d_conv = cfg.int("mamba_d_state", 16), cfg.int("mamba_d_conv", 4)
    dtype = _model_dtype(config, cfg.data)

    def states(tp: int, dtype: str) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.mamba1_state_shape
        dim = _divide(inner, tp, "Mamba intermediate size")
        return [(dim * (d_conv - 1), dtype), (dim * d_state, dtype)]

    return ModelShape(
        architecture=arch,
        model_type="jamba",
        dtype=dtype,
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        mamba=MambaState("mamba1", states),
        derived_max_model_len=_derived_max_len(cfg),
    )


def _nemotron_h(config: dict[str, Any], arch: str) -> ModelShape:
    """Nemotron-H: ``hybrid_override_pattern`` of M (Mamba-2), * (attention), - / E (MLP)."""
    cfg = _text_config(config, {})
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ModelConfigError("config.json: missing 'hybrid_override_pattern'")
    unknown = set(pattern) - set("M*-E")
    if unknown:
        raise UnsupportedModel(f"{arch}: layer codes {sorted(unknown)} are not modelled")
    heads, kv_heads, head = _attention_heads(cfg)
    layers = tuple(
        LayerKind("mamba") if c == "M" else LayerKind("full_attention")
        for c in pattern
        if c in "M*"
    )
    m_heads, head_dim = cfg.int("mamba_num_heads"), cfg.int("mamba_head_dim")
    groups, d_state = cfg.int("n_groups"), cfg.int("ssm_state_size")
    kernel = cfg.int("conv_kernel")
    dtype = _model_dtype(config, cfg.data)
    # NemotronHForCausalLMConfig: the SSM state defaults to float32 (accuracy).
    ssm_dtype = _TORCH_DTYPE_NAMES.get(str(cfg.get("mamba_ssm_cache_dtype", "float32")))
    if ssm_dtype is None:
        raise ModelConfigError("config.json: unknown mamba_ssm_cache_dtype")

    def states(tp: int, dtype: str) -> list[tuple[int, str]]:
        # MambaStateShapeCalculator.mamba2_state_shape: groups grow to cover head shards.
        n_groups = groups if groups % tp == 0 else tp
        conv_dim = m_heads * head_dim + 2 * n_groups * d_state
        return [
            (_divide(conv_dim, tp, "Mamba-2 conv dim") * (kernel - 1), dtype),
            (_divide(m_heads, tp, "mamba_num_heads") * head_dim * d_state, ssm_dtype),
        ]

    return ModelShape(
        architecture=arch,
        model_type="nemotron_h",
        dtype=dtype,
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        mamba=MambaState("mamba2", states),
        derived_max_model_len=_derived_max_len(cfg),
    )


_ARCHITECTURES: dict[str, Callable[[dict[str, Any], str], ModelShape]] = {
    **{
        a: _dense
        for a in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Phi3ForCausalLM",
        )
    },
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "Gemma3ForConditionalGeneration": _gemma,
    "GptOssForCausalLM": _gpt_oss,
    "Llama4ForCausalLM": _llama4,
    "Llama4ForConditionalGeneration": _llama4,
    "DeepseekV2ForCausalLM": _deepseek_mla,
    "DeepseekV3ForCausalLM": _deepseek_mla,
    "Qwen3NextForCausalLM": _qwen3_next,
    "JambaForCausalLM": _jamba,
    "NemotronHForCausalLM": _nemotron_h,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The layout-relevant facts of ``config`` (a parsed config.json)."""
    if not isinstance(config, dict):
        raise ModelConfigError("config.json must be a JSON object")
    archs = config.get("architectures")
    if not archs:
        raise ModelConfigError("config.json: missing 'architectures'")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError("config.json: 'architectures' must be a list of names")
    arch = archs[0]
    adapter = _ARCHITECTURES.get(arch)
    if adapter is None:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported by the Spillway planner (no KV-layout "
            f"rule for it); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shape = adapter(config, arch)
    if not shape.layers:
        raise ModelConfigError("config.json: the model has no layers")
    return shape


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LayoutRequest:
    """Deployment inputs that change the layout."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"


@dataclass(frozen=True)
class _Spec:
    """One layer's cache spec on one rank (vLLM ``KVCacheSpec``), hashable for bucketing."""

    kind: Kind
    block_size: int
    page_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    per_token: int = 0  # attention bytes per token (0 for Mamba)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group as vLLM builds it, on one rank."""

    kind: Kind
    layer_indices: tuple[int, ...]
    tokens_per_block: int
    page_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    padded_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of this group holds on one rank (its layers' pages)."""
        return self.page_bytes * self.num_layers


@dataclass(frozen=True)
class KVLayout:
    shape: ModelShape
    gpu: Gpu
    attention_backend: str | None
    kv_cache_dtype: str
    kv_dtype_bytes: int
    block_size: int
    mamba_cache_mode: Literal["align", "none"] | None
    mamba_page_bytes: int | None
    mamba_page_padded_bytes: int | None
    groups: tuple[KVGroup, ...]
    tokens_per_hash: int
    worker_bytes_per_block: int
    kv_heads_per_rank: int
    tp_replicas: int
    notes: tuple[str, ...] = field(default=())

    @property
    def replicated_mla(self) -> bool:
        return self.shape.mla_latent > 0 and self.tp_replicas > 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kv_dtype(shape: ModelShape, kv_cache_dtype: str) -> tuple[str, int]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"kv-cache dtype {kv_cache_dtype!r} is not modelled; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    resolved = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return resolved, DTYPE_BYTES[resolved]


def _backend(
    shape: ModelShape, gpu: Gpu, kv_cache_dtype: str, block_size: int | None
) -> Backend | None:
    if not any(layer.kind != "mamba" for layer in shape.layers):
        return None
    if shape.mla_latent:
        return gpu.mla_backend(kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    return gpu.attention_backend(
        mm_prefix=shape.mm_prefix, kv_cache_dtype=kv_cache_dtype, sinks=shape.sinks
    )


def compute_layout(shape: ModelShape, gpu: Gpu, request: LayoutRequest) -> KVLayout:
    """The KV-cache groups, hash unit and bytes per block vLLM 0.33.0 builds."""
    tp = request.tensor_parallel_size
    if tp < 1 or request.pipeline_parallel_size < 1:
        raise ValueError("parallel sizes must be at least 1")
    if request.pipeline_parallel_size != 1:
        raise UnsupportedModel(
            "pipeline parallelism is not modelled (each stage holds a subset of the "
            "layers and vLLM pads groups per stage)"
        )
    if request.dtype != "auto":
        if request.dtype not in ("bfloat16", "float16"):
            raise UnsupportedModel(
                f"dtype {request.dtype!r} is not modelled (auto, bfloat16, float16)"
            )
        shape = replace(shape, dtype=request.dtype)
    if shape.num_attention_heads % tp:
        raise UnsupportedModel(
            f"the {shape.num_attention_heads} attention heads are not divisible by TP {tp}; "
            "vLLM refuses this tensor-parallel size"
        )
    kv_dtype, kv_bytes = _kv_dtype(shape, request.kv_cache_dtype)
    notes = list(shape.notes)
    backend = _backend(shape, gpu, request.kv_cache_dtype, request.block_size)

    # Per-token attention page on one rank (AttentionSpec with block_size 1).
    kv_heads = 1 if shape.mla_latent else max(1, shape.num_kv_heads // tp)
    if not shape.mla_latent and shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise UnsupportedModel(f"{shape.num_kv_heads} KV heads cannot be split evenly over TP {tp}")
    if not shape.mla_latent and tp > shape.num_kv_heads:
        notes.append(
            f"TP {tp} exceeds the {shape.num_kv_heads} KV heads: each rank stores a full "
            "replicated head"
        )
    per_token = kv_heads * (shape.head_size + shape.head_size_v) * kv_bytes

    # Phase 1: the kernels' preferred block size, unless forced.
    if request.block_size is not None:
        if request.block_size < 1:
            raise ValueError("block size must be positive")
        if backend is not None and not backend.blocks.accepts(request.block_size):
            raise UnsupportedModel(
                f"block size {request.block_size} is not supported by the "
                f"{backend.name} attention backend vLLM picks on {gpu.name}"
            )
        block = request.block_size
    else:
        block = backend.blocks.preferred() if backend is not None else 16

    # Phase 2: attention+Mamba hybrids (Platform._align_hybrid_block_size).
    mamba_mode: Literal["align", "none"] | None = None
    mamba_page = mamba_padded = None
    mamba_block = 0
    if shape.mamba is not None:
        if backend is None:
            raise UnsupportedModel("attention-free Mamba models are not modelled")
        mamba_mode = "align" if request.enable_prefix_caching else "none"
        mamba_page = shape.mamba.page_bytes(tp, shape.dtype)
        align = max(backend.blocks.base, block)
        if shape.mla_latent:
            align = max(align, 128)  # MLA decode kernels need 128-aligned block counts
        if mamba_mode == "align" and shape.gdn and gpu.gdn_checkpoint_alignment:
            align = math.lcm(align, gpu.gdn_checkpoint_alignment)
        attn_block = align * _cdiv(mamba_page, align * per_token)
        attn_block = backend.blocks.base * _cdiv(attn_block, backend.blocks.base)
        if block < attn_block:
            block = attn_block
            notes.append(
                f"block size raised to {block} tokens so an attention page holds a "
                f"{shape.mamba.family} state"
            )
        if not backend.blocks.accepts(block):
            raise UnsupportedModel(f"aligned block size {block} is not supported by {backend.name}")
        if block * per_token != mamba_page:
            mamba_padded = block * per_token
        if mamba_mode == "align":
            mamba_block = block
        else:
            if request.max_model_len is None:
                raise ValueError("max_model_len is needed without prefix caching")
            mamba_block = request.max_model_len

    specs: list[_Spec] = []
    for layer in shape.layers:
        if layer.kind == "mamba":
            assert mamba_page is not None
            specs.append(_Spec("mamba", mamba_block, mamba_padded or mamba_page))
            continue
        if layer.kind == "sliding_window" and shape.mla_latent:
            raise UnsupportedModel("sliding-window MLA is not modelled")
        specs.append(
            _Spec(
                layer.kind,
                block,
                block * per_token,
                layer.sliding_window,
                layer.attention_chunk_size,
                per_token,
            )
        )

    groups = _group(specs, notes)
    tokens_per_hash = _tokens_per_hash(groups, mamba_mode)
    # Padding layers own no memory: a block costs the largest real group.
    worker_bytes = max(g.bytes_per_block for g in groups)
    # MLA latents are identical on every TP rank (max_tp_shards = 1).
    tp_replicas = tp if shape.mla_latent else 1
    return KVLayout(
        shape=shape,
        gpu=gpu,
        attention_backend=backend.name if backend else None,
        kv_cache_dtype=kv_dtype,
        kv_dtype_bytes=kv_bytes,
        block_size=block,
        mamba_cache_mode=mamba_mode,
        mamba_page_bytes=mamba_page,
        mamba_page_padded_bytes=mamba_padded,
        groups=groups,
        tokens_per_hash=tokens_per_hash,
        worker_bytes_per_block=worker_bytes,
        kv_heads_per_rank=kv_heads,
        tp_replicas=tp_replicas,
        notes=tuple(notes),
    )


def _unify_pages(specs: list[_Spec]) -> list[_Spec]:
    """``unify_kv_cache_spec_page_size``: grow smaller attention blocks, else pad."""
    largest = max(s.page_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_bytes == largest:
            out.append(s)
        elif s.kind != "mamba" and largest % s.page_bytes == 0:
            ratio = largest // s.page_bytes
            out.append(replace(s, block_size=s.block_size * ratio, page_bytes=largest))
        elif s.kind != "mla":  # Mamba and non-MLA attention pages are padded
            out.append(replace(s, page_bytes=largest))
        else:
            raise UnsupportedModel(
                "MLA pages that do not divide the largest page cannot be unified"
            )
    return out


def _group(specs: list[_Spec], notes: list[str]) -> tuple[KVGroup, ...]:
    """``get_kv_cache_groups`` for the layer-outer (LBHNC) layout."""
    if len(set(specs)) == 1:
        s = specs[0]
        return (
            KVGroup(
                s.kind,
                tuple(range(len(specs))),
                s.block_size,
                s.page_bytes,
                s.sliding_window,
                s.attention_chunk_size,
            ),
        )
    if len({(s.kind, s.block_size, s.sliding_window, s.attention_chunk_size) for s in specs}) == 1:
        # UniformTypeKVCacheSpecs: one group whose layers' pages differ.
        raise UnsupportedModel(
            "layers of one attention type with different page sizes (a UniformType "
            "group) are not modelled"
        )
    unified = _unify_pages(specs)
    buckets: dict[_Spec, list[int]] = {}
    for index, spec in enumerate(unified):
        buckets.setdefault(spec, []).append(index)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups: list[KVGroup] = []
    for spec, layers in buckets.items():
        num_groups = _cdiv(len(layers), group_size)
        padding = num_groups * group_size - len(layers)
        if padding:
            notes.append(
                f"vLLM adds {padding} padding layer(s) to the {spec.kind} layers "
                f"(group size {group_size})"
            )
        for i in range(num_groups):
            members = tuple(layers[i::num_groups])
            groups.append(
                KVGroup(
                    spec.kind,
                    members,
                    spec.block_size,
                    spec.page_bytes,
                    spec.sliding_window,
                    spec.attention_chunk_size,
                    padded_layers=group_size - len(members),
                )
            )
    return tuple(groups)


def _tokens_per_hash(groups: tuple[KVGroup, ...], mamba_mode: str | None) -> int:
    """``resolve_kv_cache_block_sizes`` with a KV connector on (offloading)."""
    sizes = [g.tokens_per_block for g in groups]
    if len(groups) == 1:
        return sizes[0]
    if mamba_mode == "none":
        return math.lcm(*sizes)  # Mamba outside align mode: hash at the scheduler block
    return math.gcd(*sizes)
