"""The KV-cache layout a plan request asks for: the model's shape from its config.json,
the separate drafter's from its own, the context length checked, and
``kv_layout.compute_layout`` called with the request's deployment inputs.
"""

from __future__ import annotations

from typing import Any

from spillway_engine.planner.families import model_shape
from spillway_engine.planner.families.dense import ARCHITECTURES as DENSE_ARCHITECTURES
from spillway_engine.planner.families.eagle3 import LLAMA_EAGLE3, eagle3_shape
from spillway_engine.planner.gpus import get_gpu
from spillway_engine.planner.kv_layout import KVLayout, LayoutRequest, compute_layout
from spillway_engine.planner.plan_schema import PlanRefused, PlanRequest
from spillway_engine.planner.shape import ModelShape, UnsupportedModel


def _vocab_size(config: dict[str, Any]) -> Any:
    text = config.get("text_config")
    return (text if isinstance(text, dict) else config).get("vocab_size")


def _drafter(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None
) -> ModelShape | None:
    """The separate drafter's shape (draft model or EAGLE-3 head), or None."""
    method = request.speculative_method
    if method not in ("draft_model", "eagle3"):
        if draft_config is not None:
            raise PlanRefused(
                f"a drafter config.json is only read for draft_model or eagle3, not {method!r}"
            )
        return None
    if draft_config is None:
        return None  # compute_layout refuses with the reason
    if method == "draft_model":
        target, draft = _vocab_size(config), _vocab_size(draft_config)
        if target != draft:  # SpeculativeConfig.verify_equal_vocab_size_if_draft_model
            raise PlanRefused(
                "Target and draft model should have the same vocabulary size. "
                f"Target model vocab_size={target}. Draft model vocab_size={draft}."
            )
        return _own_windows(model_shape(draft_config), draft_config)
    return _own_windows(eagle3_shape(draft_config), draft_config)


def _own_windows(drafter: ModelShape, draft_config: dict[str, Any]) -> ModelShape:
    """A drafter's sliding layers must say so per layer (layer_types): a Llama-style
    layer without one takes the target's cache window in vLLM, not its config's."""
    text = draft_config.get("text_config")
    declared = (text if isinstance(text, dict) else draft_config).get("layer_types")
    sliding = any(layer.kind == "sliding_window" for layer in drafter.layers)
    llama_style = drafter.architecture in {*DENSE_ARCHITECTURES, *LLAMA_EAGLE3}
    if sliding and declared is None and llama_style:
        raise UnsupportedModel(
            f"a {drafter.architecture} drafter whose sliding_window applies to every layer "
            "without layer_types is not modelled (vLLM gives its layers the target's window)"
        )
    return drafter


def layout_for(
    config: dict[str, Any], request: PlanRequest, draft_config: dict[str, Any] | None = None
) -> tuple[KVLayout, int]:
    """The layout ``request`` asks for, and the context length it is planned for."""
    shape = model_shape(config)
    drafter = _drafter(config, request, draft_config)
    max_len = request.max_model_len or shape.derived_max_model_len
    if max_len > shape.derived_max_model_len:
        raise PlanRefused(
            f"max_model_len {max_len} exceeds the model's context length "
            f"{shape.derived_max_model_len} (vLLM refuses it unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
        )
    layout = compute_layout(
        shape,
        get_gpu(request.gpu),
        LayoutRequest(
            tensor_parallel_size=request.tensor_parallel_size,
            pipeline_parallel_size=request.pipeline_parallel_size,
            pp_layer_partition=(
                None
                if request.pipeline_layer_partition is None
                else tuple(request.pipeline_layer_partition)
            ),
            kv_cache_dtype=request.kv_cache_dtype,
            dtype=request.dtype,
            max_model_len=max_len,
            block_size=request.block_size,
            enable_prefix_caching=request.enable_prefix_caching,
            speculative_method=request.speculative_method,
            num_speculative_tokens=request.num_speculative_tokens,
            drafter=drafter,
            cuda_major=request.cuda_major,
        ),
    )
    return layout, max_len
