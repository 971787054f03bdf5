"""Tiny local models for the emulated engine: a config.json and a trained tokenizer.

No hub access: the tokenizer is a byte-level BPE trained here with the ``tokenizers``
package on a few sentences, so vLLM's real tokenizer path (transformers' fast
tokenizer) serves it. The weights are never read (the emulated worker builds the
model on the meta device), so none are written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "spillway moves kv cache pages between the gpu and the host pool",
    "a prefix cache hit skips the prefill of the tokens it covers",
    "pack my box with five dozen liquor jugs",
    "vllm schedules requests in steps and allocates blocks for their tokens",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


def llama_config(num_layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """A Llama-style config small enough to plan and serve in seconds."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def gemma3_config(
    num_layers: int = 4, sliding_window: int = 64, **overrides: Any
) -> dict[str, Any]:
    """A Gemma-3-style text model: sliding-window layers with one full layer in six."""
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def qwen3_next_config(num_layers: int = 4, **overrides: Any) -> dict[str, Any]:
    """A Qwen3-Next-style hybrid: Gated DeltaNet (linear attention) layers with full
    attention every fourth layer, two KV-cache groups of different kinds."""
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def deepseek_v2_config(num_layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """A DeepSeek-V2-style MLA model: one latent KV cache (kv_lora_rank + rope dims)
    per layer, the same on every tensor-parallel rank; MoE layers from the third on."""
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def write_tokenizer(
    model_dir: Path,
    vocab_size: int = VOCAB_SIZE,
    extra_special: dict[str, str] | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> None:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json in ``model_dir``.

    ``extra_special``: named special tokens (a multimodal processor's image tokens),
    given ids after ``<pad>``, ``<s>``, ``</s>`` and exposed as tokenizer attributes;
    ``extra_tokens``: more whole tokens a processor looks up in the vocabulary, after
    those (all inside ``vocab_size``)."""
    extra_special = extra_special or {}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # ids 0, 1, 2 as the configs say, then the named ones in order
        special_tokens=["<pad>", BOS, EOS, *extra_special.values(), *extra_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": "<pad>",
                "model_max_length": 1 << 20,
                "add_bos_token": False,
                **({"extra_special_tokens": extra_special} if extra_special else {}),
            }
        )
    )


#: What vLLM loads at start-up for a multimodal model besides the tokenizer, as a real
#: model directory has it (public values of google/gemma-3-*-it and
#: meta-llama/Llama-4-Scout-17B-16E-Instruct): model_type -> (preprocessor_config.json,
#: processor_config.json, the processor's named special tokens, the config's token-id
#: fields -> the name of the token they hold, whole tokens the processor looks up).
_PROCESSOR_FILES: dict[
    str, tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str], tuple[str, ...]]
]
_PROCESSOR_FILES = {
    "gemma3": (
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_seq_length": 256,
            "resample": 2,
            "rescale_factor": 1 / 255,
            "size": {"height": 896, "width": 896},
        },
        {"image_seq_length": 256, "processor_class": "Gemma3Processor"},
        {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        {
            "boi_token_index": "boi_token",
            "eoi_token_index": "eoi_token",
            "image_token_index": "image_token",
        },
        # vLLM's Gemma 3 processor merges newline runs (single tokens in Gemma's vocabulary)
        ("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
    ),
    "llama4": (
        {
            "image_processor_type": "Llama4ImageProcessorFast",
            "processor_class": "Llama4Processor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "max_patches": 16,
            "resample": 2,
            "rescale_factor": 1 / 255,
            "resize_to_max_canvas": False,
            "size": {"height": 336, "width": 336},
        },
        {
            "fake_image_token": "<|image|>",
            "image_token": "<|image|>",
            "patch_size": 14,
            "processor_class": "Llama4Processor",
        },
        {
            "image_start": "<|image_start|>",
            "image_end": "<|image_end|>",
            "image": "<|image|>",
            "patch": "<|patch|>",
            "tile_x": "<|tile_x_separator|>",
            "tile_y": "<|tile_y_separator|>",
        },
        {
            "boi_token_index": "image_start",
            "eoi_token_index": "image_end",
            "image_token_index": "patch",
        },
        (),
    ),
}


def write_model(model_dir: Path, config: dict[str, Any]) -> Path:
    """A servable model directory (config, tokenizer, generation config), no weights;
    a multimodal model's (Gemma 3, Llama 4) also has its processor's files, and its
    image token ids are the tiny tokenizer's."""
    model_dir.mkdir(parents=True, exist_ok=True)
    processor = _PROCESSOR_FILES.get(config.get("model_type", ""))
    special: dict[str, str] = {}
    tokens: tuple[str, ...] = ()
    if processor is not None:
        preprocessor, processor_config, special, id_fields, tokens = processor
        config = dict(config)
        names = list(special)
        for field_name, token in id_fields.items():
            config[field_name] = 3 + names.index(token)  # after <pad>, <s>, </s>
        (model_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
        (model_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=1))
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    write_tokenizer(model_dir, config["vocab_size"], special, tokens)
    return model_dir


#: Per-layer lists and index lists a shrunk config keeps consistent with its layers.
_LAYER_INDEX_LISTS = ("full_attn_layers", "kda_layers", "no_rope_layers", "mlp_only_layers")
_LAYER_INDEX_STRINGS = ("moe_layers_enum",)


def shrink_config(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A real config.json cut to its first ``num_layers`` layers, with this module's
    tokenizer (vocabulary, special token ids) and no weight quantisation (its kernels
    need CUDA; the KV cache does not depend on it).

    Per-layer lists (``layer_types``, ``compress_ratios``, with any MTP entries after
    the decoder's) and patterns (``hybrid_override_pattern``) are cut to the kept
    layers, lists of layer indices (Kimi-Linear's, 1-based there) and Step-3.5's
    ``moe_layers_enum`` filtered to them. A multimodal config's ``text_config`` is cut
    the same way. Widths are kept: the model is built on the meta device, so they cost
    nothing but the KV bytes per token.
    """
    out = json.loads(json.dumps(config))
    out.pop("quantization_config", None)
    text = out.get("text_config")
    target = text if isinstance(text, dict) else out
    _shrink_layers(target, num_layers)
    for cfg in {id(out): out, id(target): target}.values():
        cfg["vocab_size"] = VOCAB_SIZE
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"] = 1, 2, 0
    out.setdefault("torch_dtype", "bfloat16")
    return out


def _shrink_layers(cfg: dict[str, Any], num_layers: int) -> None:
    total = cfg["num_hidden_layers"]
    extra = int(cfg.get("num_nextn_predict_layers") or 0)
    for key, value in list(cfg.items()):
        if isinstance(value, list) and key not in _LAYER_INDEX_LISTS and (
            total <= len(value) <= total + extra
        ):
            cfg[key] = value[:num_layers] + value[total:]  # MTP entries stay
        elif isinstance(value, str) and key == "hybrid_override_pattern":
            cfg[key] = value[:num_layers]
    linear = cfg.get("linear_attn_config")
    for holder in (cfg, linear if isinstance(linear, dict) else {}):
        for key in _LAYER_INDEX_LISTS:
            if isinstance(holder.get(key), list) and key != "mlp_only_layers":
                base = 1 if holder is linear else 0
                holder[key] = [i for i in holder[key] if i < num_layers + base]
    for key in _LAYER_INDEX_STRINGS:
        if isinstance(cfg.get(key), str):
            kept = [i for i in cfg[key].split(",") if i.strip() and int(i) < num_layers]
            cfg[key] = ",".join(kept)
    cfg["num_hidden_layers"] = num_layers
