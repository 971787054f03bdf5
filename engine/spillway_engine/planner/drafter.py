"""Speculative decoding's drafter in the KV cache: the model's own MTP layers or a
separate drafter's (draft model, EAGLE-3 head), appended after the target's layers as
vLLM's proposer builds them into the same forward context. Part of
``kv_layout.compute_layout``'s step 1 (the per-layer specs).
"""

from __future__ import annotations

from dataclasses import replace

from spillway_engine.planner.layout_types import LayoutRequest
from spillway_engine.planner.shape import LayerKind, ModelShape, UnsupportedModel

#: --speculative-config methods whose drafter the planner models
SPECULATIVE_METHODS = ("mtp", "draft_model", "eagle3")


def check_drafter(shape: ModelShape, request: LayoutRequest) -> None:
    """The drafters vLLM refuses beside a model, or the planner does not model."""
    if request.speculative_method == "mtp" and shape.model_type == "glm5_next_text":
        # SpeculativeConfig maps only model_type glm5_next to its MTP drafter
        raise UnsupportedModel(
            f"--speculative-config method=mtp with {shape.architecture} of model_type "
            "glm5_next_text: vLLM 0.33.0 refuses it (Unsupported speculative method: 'mtp')"
        )
    if request.speculative_method not in (None, "mtp") and any(
        x.kind == "circular_buffer" for x in shape.layers
    ):
        raise UnsupportedModel(
            f"speculative decoding with {shape.architecture} and a separate drafter is not "
            "modelled (its layers beside the packed ring and KDA groups); its own MTP "
            "layers (method=mtp) are"
        )


def with_drafter(
    shape: ModelShape, request: LayoutRequest, notes: list[str]
) -> tuple[ModelShape, int]:
    """The shape with the drafter's cache layers appended, and the draft tokens per step.

    vLLM's proposer builds the drafter into the same forward context after the target
    (its layers come last): each draft layer gets a spec from its own heads (``is_draft``
    does not take part in grouping), so a draft layer with the target's spec joins the
    target's group and one with other heads makes a one-type group of mixed pages;
    Mamba convolution states keep ``num_speculative_tokens`` more rows.
    """
    method = request.speculative_method
    if method is None:
        return shape, 0
    if method not in SPECULATIVE_METHODS:
        raise UnsupportedModel(
            f"speculative method {method!r} is not modelled (mtp: the model's own MTP "
            "heads; draft_model and eagle3 with the drafter's config.json)"
        )
    if request.num_speculative_tokens < 1:
        raise UnsupportedModel("num_speculative_tokens must be at least 1 with a drafter")
    if method == "mtp":
        if not shape.mtp_layers:
            raise UnsupportedModel(
                f"{shape.architecture}: the config has no MTP layers (num_nextn_predict_layers "
                "/ mtp_num_hidden_layers) for --speculative-config method=mtp"
            )
        drafted = shape.mtp_layers
        what = "MTP drafter"
    else:
        drafted = drafter_layers(shape, request)
        what = f"{method} drafter ({request.drafter.architecture})"  # type: ignore[union-attr]
    notes.append(
        f"{what}: {len(drafted)} cache layer(s) appended after the model's "
        f"{len(shape.layers)}, {request.num_speculative_tokens} draft token(s) per step"
    )
    return replace(shape, layers=shape.layers + drafted), request.num_speculative_tokens


def drafter_layers(shape: ModelShape, request: LayoutRequest) -> tuple[LayerKind, ...]:
    """A separate drafter's cache layers with its own heads (the KV dtype is the
    target's: vLLM builds the draft's ModelConfig with the target's dtype)."""
    draft = request.drafter
    method = request.speculative_method
    if draft is None:
        raise UnsupportedModel(
            f"--speculative-config method {method!r} needs the drafter's config.json (its "
            "'model'); a drafter the planner cannot see is not modelled"
        )
    tp = request.tensor_parallel_size
    if draft.mla_latent or draft.mamba is not None:
        raise UnsupportedModel(
            f"a {method} drafter with MLA or Mamba layers ({draft.architecture}) is not modelled"
        )
    if shape.mla_latent or shape.mamba is not None:
        raise UnsupportedModel(
            f"a {method} drafter beside {shape.architecture}'s "
            f"{'MLA' if shape.mla_latent else 'Mamba'} layers is not modelled (only "
            "attention targets)"
        )
    # EngineArgs sets CacheConfig.sliding_window for an all-sliding target; a draft layer
    # without a window of its own takes it (Attention's fallback), so it slides alike.
    windows = {layer.sliding_window for layer in shape.layers}
    target_window = None
    if all(layer.kind == "sliding_window" for layer in shape.layers) and len(windows) == 1:
        target_window = windows.pop()
    if any(layer.kind not in ("full_attention", "sliding_window") for layer in draft.layers):
        raise UnsupportedModel(f"a {method} drafter with chunked-local layers is not modelled")
    mixed = len({layer.kind for layer in shape.layers}) > 1
    if draft.num_attention_heads % tp:
        # ModelConfig.verify_with_parallel_config on the draft's config
        raise UnsupportedModel(
            f"the drafter's {draft.num_attention_heads} attention heads are not divisible "
            f"by TP {tp}: vLLM refuses it (Total number of attention heads "
            f"({draft.num_attention_heads}) must be divisible by tensor parallel size ({tp}))"
        )
    if draft.num_kv_heads % tp and tp % draft.num_kv_heads:
        raise UnsupportedModel(
            f"the drafter's {draft.num_kv_heads} KV heads cannot be split evenly over TP {tp}"
        )
    if draft.head_size != draft.head_size_v:
        raise UnsupportedModel("a drafter with different K and V head sizes is not modelled")
    same = (draft.num_kv_heads, draft.head_size) == (shape.num_kv_heads, shape.head_size)
    if mixed and not same:
        # other pages beside several attention kinds regroup the target's layers (block
        # sizes unified, buckets split, the hash unit: vLLM #48919); unchecked, so refused
        raise UnsupportedModel(
            f"a {method} drafter with other KV heads than {shape.architecture}'s, beside its "
            "mix of attention kinds, is not modelled (vLLM #48919); a drafter with the "
            "target's heads is"
        )
    if any(layer.kind not in ("full_attention", "sliding_window") for layer in shape.layers):
        raise UnsupportedModel(
            f"a {method} drafter beside {shape.architecture}'s chunked-local layers is not "
            "modelled"
        )
    heads = {} if same else {"num_kv_heads": draft.num_kv_heads, "head_size": draft.head_size}
    made: dict[int | None, LayerKind] = {}
    out = []
    for layer in draft.layers:
        window = layer.sliding_window if layer.kind == "sliding_window" else target_window
        if window not in made:
            kind = "full_attention" if window is None else "sliding_window"
            made[window] = LayerKind(kind, window, **heads)
        out.append(made[window])
    return tuple(out)
