"""A model's layout-relevant facts (``ModelShape``) and typed reads of its config.json.

Each architecture family's rule (``planner/families/``) turns a config.json into a
``ModelShape``: what every cache-holding layer stores, the heads, the dtype and the
derived context length. ``planner/kv_layout.py`` turns a shape into vLLM's KV-cache
groups. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal[
    "full_attention", "sliding_window", "chunked_local", "mla", "mamba", "circular_buffer"
]

DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
}
#: the --kv-cache-dtype values the planner models (vLLM's whole list and what it does
#: with the rest: planner/attention_backend.py)
KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"
)
TORCH_DTYPE_NAMES = {
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


@dataclass(frozen=True)
class LayerKind:
    """What one cache-holding layer stores, in module order."""

    kind: Kind
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    #: this layer's own KV heads / head size where they differ from the model's (Gemma 4)
    num_kv_heads: int | None = None
    head_size: int | None = None
    #: bytes per token of a cache with its own fixed format, whatever the KV dtype and
    #: TP (the sparse-attention indexer's uint8 keys and scales, DeepSeek-V3.2); bytes
    #: per stored state when ``tokens_per_state`` > 1
    bytes_per_token: int | None = None
    #: tokens one stored state covers (vLLM ``AttentionSpec.tokens_per_state``): a
    #: compressed MLA cache keeps ``block // tokens_per_state`` states a block
    tokens_per_state: int = 1
    #: this cache's own fixed block size (DeepSeek-V4's sliding-window latent and
    #: compressor states), whatever the scheduler's block; None: the scheduler's
    block_size: int | None = None
    #: the page is rounded up to a multiple of this many bytes (vLLM's MLA
    #: ``alignment``: 576 for FlashMLA's fp8_ds_mla rows)
    page_alignment: int | None = None
    #: the fixed kernel page (tokens) its backend splits blocks into: vLLM sets
    #: ``block_stride_alignment = MultipleOf(it)`` (GLM-5 Next's kpool indexer)
    kernel_block_tokens: int | None = None
    #: a ``circular_buffer`` layer's ring grows in steps of this many tokens, enough
    #: for one pool plus the draft tokens, rounded to a power of two of steps
    ring_unit: int | None = None


@dataclass(frozen=True)
class MambaState:
    """A Mamba/GDN state: ``(elements, dtype)`` per tensor, as a function of (TP, dtype,
    speculative tokens: the convolution state keeps one more row per draft token)."""

    family: str
    states: Callable[[int, str, int], list[tuple[int, str]]]

    #: the prefill checkpoint alignment (tokens) of the kernel the layers run, from
    #: (compute capability major, model dtype), carried by the spec only (one more
    #: state block per request; GLM-5 Next's KDA); None: no prefill checkpoints
    checkpoint_alignment: Callable[[int, str], int | None] | None = None

    def page_bytes(self, tp: int, dtype: str, num_spec: int = 0) -> int:
        return sum(n * DTYPE_BYTES[dt] for n, dt in self.states(tp, dtype, num_spec))


@dataclass(frozen=True)
class SparseMlaDims:
    """The config fields vLLM 0.33.0's sparse-MLA backends check before taking a model
    (``supports_combination``), and what its config hook does to an ``auto`` cache."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    index_topk: int
    #: the cache dtype the architecture's ``VerifyAndUpdateConfig`` puts in place of
    #: ``auto`` on SM10x (GLM-5: fp8_e4m3, GLM-5 Next: fp8); None: it leaves auto
    sm10x_auto_kv_dtype: str | None = None
    #: the indexer's block alignment on SM12x, where DeepGEMM's paged MQA takes only
    #: 64-entry pages (GLM-5 Next's kpool indexer); None: as on other GPUs
    sm12x_block_alignment: int | None = None


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
    #: sparse MLA (DeepSeek sparse attention): the latents run on sparse-MLA kernels
    sparse_mla: bool = False
    #: the sparse-MLA config fields the backends check (None: not sparse MLA)
    sparse_dims: SparseMlaDims | None = None
    #: DeepSeek-V4's compressed sparse attention: its own FlashMLA kernels, and an
    #: indexer backend that declares only block-outermost KV layouts, so vLLM packs
    #: each block's pages side by side (``_get_packed_kv_cache_groups``)
    compressed_sparse_mla: bool = False
    #: the smallest kernel block (tokens) of a backend besides the attention one that
    #: hybrid block alignment rounds to (GLM-5 Next's indexer: 32 pooled entries)
    block_alignment: int = 1
    mamba: MambaState | None = None
    gdn: bool = False
    #: GDN key head width (``linear_key_head_dim``): Blackwell's FlashInfer GDN needs 128
    gdn_head_k_dim: int = 0
    sinks: bool = False
    mm_prefix: bool = False
    #: the cache-holding layers an MTP drafter (``--speculative-config method=mtp``) adds
    mtp_layers: tuple[LayerKind, ...] = ()
    derived_max_model_len: int = 2048
    notes: tuple[str, ...] = ()
    #: ``num_hidden_layers``: the decoder layers vLLM splits over pipeline stages
    #: (``get_pp_indices``); 0: one cache layer per decoder layer, ``len(layers)``
    num_hidden_layers: int = 0
    #: the decoder layer each of ``layers`` sits in, where that is not layer i in decoder
    #: layer i (several caches in one decoder layer, decoder layers without a cache);
    #: empty: ``range(len(layers))``
    layer_positions: tuple[int, ...] = ()
    #: why pipeline parallelism is not modelled for this model (None: it is)
    pipeline_refusal: str | None = None


#: A family rule: (config.json, architecture name) -> the shape.
ShapeRule = Callable[[dict[str, Any], str], ModelShape]


_MISSING = object()

# Integers past these are no model's: without a bound, a hostile config.json (say
# num_hidden_layers = 10**12) makes the planner build that many layers, or
# multiply numbers of thousands of digits, instead of refusing it in one line.
INT_MAX = 2**40
LAYERS_MAX = 100_000
_INT_MAXIMA = {"num_hidden_layers": LAYERS_MAX, "num_layers": LAYERS_MAX, "n_layer": LAYERS_MAX}


class ConfigReader:
    """Typed reads from a config.json dict with clear errors."""

    def __init__(self, data: dict[str, Any], where: str = "config.json") -> None:
        self.data = data
        self.where = where

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1,
            maximum: int | None = None) -> int:
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
        top = maximum if maximum is not None else _INT_MAXIMA.get(key, INT_MAX)
        if value > top:
            raise ModelConfigError(f"{self.where}: {key!r} must be <= {top}, got "
                                   f"{value if value.bit_length() < 200 else 'a huge number'}")
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


def model_dtype(config: dict[str, Any], text: dict[str, Any]) -> str:
    """vLLM's ``dtype="auto"`` on CUDA: the checkpoint's dtype, float32 downcast to bf16."""
    raw = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    raw = raw or config.get("dtype") or "float32"  # transformers' default when absent
    name = TORCH_DTYPE_NAMES.get(str(raw).removeprefix("torch.").lower())
    if name is None:
        raise ModelConfigError(f"config.json: unknown torch_dtype {raw!r}")
    return "bfloat16" if name == "float32" else name


def text_config(config: dict[str, Any], defaults: dict[str, Any]) -> ConfigReader:
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ModelConfigError("config.json: 'text_config' must be an object")
    merged = dict(defaults)
    merged.update({k: v for k, v in (text or config).items() if v is not None})
    return ConfigReader(merged, "config.json text_config" if text else "config.json")


def attention_heads(cfg: ConfigReader) -> tuple[int, int, int]:
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


#: Largest RoPE scaling factor accepted (real configs use up to a few dozen).
MAX_ROPE_FACTOR = 1024


def derived_max_len(cfg: ConfigReader) -> int:
    """vLLM's derived max_model_len: the smallest length key, times the RoPE factor."""
    lengths = [cfg.int(k) for k in _MAX_LEN_KEYS if cfg.has(k)]
    length = cfg.int("model_max_length") if cfg.has("model_max_length") else min(lengths or [2048])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(cfg.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in _ROPE_ALREADY_SCALED and kind != "default":
            factor = rope.get("factor") or 1.0
            if isinstance(factor, bool) or not isinstance(factor, int | float):
                raise ModelConfigError(f"{cfg.where}: rope factor {factor!r} is not a number")
            # NaN, inf or a factor that scales the context past any real length is not a
            # config, and int() of it would crash (NaN, inf) or plan an absurd length.
            if not 0 < factor <= MAX_ROPE_FACTOR:
                raise ModelConfigError(
                    f"{cfg.where}: rope factor {factor!r} must be in (0, {MAX_ROPE_FACTOR}]"
                )
            length = int(length * factor)
    return length


def sliding_window_of(cfg: ConfigReader, key: str = "sliding_window") -> int | None:
    if not cfg.has(key):
        return None
    value = cfg.int(key, minimum=0)
    return value or None  # vLLM treats 0 as "no sliding window"


def divide_for_tp(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise UnsupportedModel(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size "
            f"({denominator}); vLLM refuses this split"
        )
    return numerator // denominator


def attention_shape(
    config: dict[str, Any],
    cfg: ConfigReader,
    arch: str,
    layers: tuple[LayerKind, ...],
    *,
    model_type: str | None = None,
    **extra: Any,
) -> ModelShape:
    """The shape of a model whose attention layers use ``num_attention_heads`` /
    ``num_key_value_heads`` / ``head_dim`` (every family but MLA); ``extra`` sets the
    family's own fields (sinks, Mamba state, notes...)."""
    heads, kv_heads, head = attention_heads(cfg)
    return ModelShape(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")) if model_type is None else model_type,
        dtype=model_dtype(config, cfg.data),
        layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        head_size_v=head,
        derived_max_model_len=derived_max_len(cfg),
        **extra,
    )
