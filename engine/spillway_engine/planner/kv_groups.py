"""Steps 3 and 4 of ``kv_layout.compute_layout``: the groups
(``kv_cache_planning.get_kv_cache_groups``): one group when every layer has the same
spec, else page unification and buckets cut into ``group_size`` layers assigned
``layers[i::n]``, or, in a block-outermost layout, packed groups; then the backing
allocation's bytes per block per rank (the largest group) and ``tokens_per_hash``
(``resolve_kv_cache_block_sizes``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from spillway_engine.arith import cdiv, round_up
from spillway_engine.planner.layout_types import CacheSpec, KVGroup
from spillway_engine.planner.shape import UnsupportedModel


def group_layers(
    specs: list[CacheSpec], notes: list[str]
) -> tuple[tuple[KVGroup, ...], bool, int]:
    """(groups, block-outermost layout, bytes per block per rank) of the layers' specs."""
    made = distinct(specs)
    # A circular-buffer ring's backend (the kpool tail's) takes only BLHNC, which
    # vLLM then uses instead of the offloading connector's LBHNC.
    block_outer = any(s.kind == "circular_buffer" for s in made)
    if block_outer:
        groups = packed_groups(specs)
        notes.append(
            f"block-outermost KV layout (BLHNC): {len(groups)} groups pack their layers' "
            "pages side by side in each block"
        )
        # _get_kv_cache_bytes_per_block: the widest group, to every stride alignment
        stride = math.lcm(*(s.stride_alignment for s in made))
        worker_bytes = round_up(max(g.bytes_per_block for g in groups), stride)
    else:
        if any(s.tokens_per_state > 1 for s in made):
            raise UnsupportedModel("compressed caches on a layer-outer KV layout are not modelled")
        groups = _group(specs, notes)
        # Padding layers own no memory: a block costs the largest real group.
        worker_bytes = max(g.bytes_per_block for g in groups)
    return groups, block_outer, worker_bytes


def _group(specs: list[CacheSpec], notes: list[str]) -> tuple[KVGroup, ...]:
    """``get_kv_cache_groups`` for the layer-outer (LBHNC) layout."""
    distinct_specs = distinct(specs)
    if len(set(distinct_specs)) == 1:
        return (_one_group(specs),)
    if (
        len({(s.kind, s.block_size, s.sliding_window, s.attention_chunk_size)
             for s in distinct_specs})
        == 1
    ):
        return (_uniform_type_group(specs, notes),)
    return _bucketed_groups(specs, distinct_specs, notes)


def _one_group(specs: list[CacheSpec]) -> KVGroup:
    """Every layer has the same spec: one group of them all."""
    s = specs[0]
    return KVGroup(
        s.kind,
        tuple(range(len(specs))),
        s.block_size,
        s.page_bytes,
        s.sliding_window,
        s.attention_chunk_size,
    )


def _uniform_type_group(specs: list[CacheSpec], notes: list[str]) -> KVGroup:
    """``UniformTypeKVCacheSpecs``: one group whose layers' pages differ; its spec's
    page is their sum, and a block holds each layer's own page."""
    s = specs[0]
    if s.kind == "mamba":  # MLA: sparse latents beside indexer keys (DeepSeek-V3.2)
        raise UnsupportedModel(f"{s.kind} layers with different page sizes are not modelled")
    pages = tuple(spec.page_bytes for spec in specs)
    notes.append(
        f"one {s.kind} group of {len(specs)} layers with {len(set(pages))} page sizes "
        "(vLLM's UniformTypeKVCacheSpecs)"
    )
    return KVGroup(
        s.kind,
        tuple(range(len(specs))),
        s.block_size,
        sum(pages),
        s.sliding_window,
        s.attention_chunk_size,
        layer_page_bytes=pages,
    )


def _bucketed_groups(
    specs: list[CacheSpec], distinct_specs: list[CacheSpec], notes: list[str]
) -> tuple[KVGroup, ...]:
    """Pages unified, layers bucketed by spec and cut into groups of ``group_size``."""
    unified = _unify_pages(specs, distinct_specs)
    # Layers by spec object, then objects merged by value (order of first use kept).
    by_object: dict[int, tuple[CacheSpec, list[int]]] = {}
    for index, spec in enumerate(unified):
        entry = by_object.get(id(spec))
        if entry is None:
            by_object[id(spec)] = (spec, [index])
        else:
            entry[1].append(index)
    buckets: dict[CacheSpec, list[int]] = {}
    for spec, layers in by_object.values():
        merged = buckets.setdefault(spec, [])
        if merged:
            merged.extend(layers)
            merged.sort()
        else:
            merged.extend(layers)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups: list[KVGroup] = []
    for spec, layers in buckets.items():
        num_groups = cdiv(len(layers), group_size)
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


def tokens_per_hash(groups: tuple[KVGroup, ...], mamba_mode: str | None) -> int:
    """``resolve_kv_cache_block_sizes`` with a KV connector on (offloading)."""
    sizes = [g.tokens_per_block for g in groups]
    if len(groups) == 1:
        return sizes[0]
    if mamba_mode == "none":
        return math.lcm(*sizes)  # Mamba outside align mode: hash at the scheduler block
    # a circular-buffer ring is never hashed
    return math.gcd(*([g.tokens_per_block for g in groups if g.prefix_cacheable] or sizes))


def distinct(specs: list[CacheSpec]) -> list[CacheSpec]:
    """The distinct spec objects, in order of first use (equal ones may repeat)."""
    return list({id(s): s for s in specs}.values())


def _unify_pages(specs: list[CacheSpec], distinct_specs: list[CacheSpec]) -> list[CacheSpec]:
    """``unify_kv_cache_spec_page_size``: grow smaller attention blocks, else pad."""
    unified = dict(zip(map(id, distinct_specs), _unify_distinct(distinct_specs), strict=True))
    return [unified[id(s)] for s in specs]


def _unify_distinct(specs: list[CacheSpec]) -> list[CacheSpec]:
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


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's ``_approximate_gcd``: the divisor in [lower_bound, max] that pads least
    (ties: the larger)."""
    low, high = max(1, lower_bound), max(values)
    if low > high:
        return low
    best = low
    best_pad: int | None = None
    for d in range(low, high + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def packed_groups(specs: list[CacheSpec]) -> tuple[KVGroup, ...]:
    """``_get_packed_kv_cache_groups``: layers bucketed by uniform type (kind, block,
    window); a bucket whose page sizes repeat one layer each is a layer pattern, split
    into groups of the same number of repeats; every group holds each layer's page."""
    if len({s.page_bytes for s in distinct(specs)}) <= 1:
        raise UnsupportedModel("packed block-outermost groups with one page size are not modelled")
    buckets: dict[tuple[object, ...], list[int]] = {}
    for index, s in enumerate(specs):
        base = "full" if s.kind in ("full_attention", "mla") else s.kind
        key = (base, s.block_size, s.sliding_window, s.attention_chunk_size)
        buckets.setdefault(key, []).append(index)
    described = []
    for layers in buckets.values():
        by_page: dict[int, list[int]] = {}
        for i in layers:
            by_page.setdefault(specs[i].page_bytes, []).append(i)
        counts = [len(v) for v in by_page.values()]
        described.append((layers, by_page, len(set(counts)) == 1, max(counts)))
    floor = max((most for _, pages, even, most in described if even and len(pages) > 1), default=0)
    repeats = (
        _approximate_gcd([most for _, _, even, most in described if even], floor)
        if floor
        else None
    )
    if repeats is None and any(specs[b[0]].kind == "sliding_window" for b, *_ in described):
        raise UnsupportedModel(
            "packed sliding-window state buckets without a layer pattern are not modelled"
        )
    def split(even: bool, most: int) -> int:
        return cdiv(most, repeats) if even and repeats is not None else 1

    # Mamba and ring buckets ("state buckets") may split down to one layer a group, so
    # the block is as wide as the widest other group; they then split to fit it.
    def state(layers: list[int]) -> bool:
        return specs[layers[0]].kind in ("mamba", "circular_buffer")

    anchor = max(
        sum(cdiv(len(v), len(layers) if state(layers) else split(even, most)) * page
            for page, v in by_page.items())
        for layers, by_page, even, most in described
    )
    groups: list[KVGroup] = []
    for layers, by_page, even, most in described:
        n = split(even, most)
        if state(layers):
            fit = max(anchor // specs[layers[0]].page_bytes, 1)
            n = max(n, cdiv(len(layers), fit))
        if n == 1:
            parts = [layers]
        else:
            pattern = list(zip(*by_page.values(), strict=False))
            parts = [[i for repeat in pattern[g::n] for i in repeat] for g in range(n)]
            if sum(map(len, parts)) != len(layers):
                raise UnsupportedModel("an uneven packed layer pattern is not modelled")
        for members in parts:
            first = specs[members[0]]
            pages = tuple(specs[i].page_bytes for i in members)
            groups.append(
                KVGroup(
                    first.kind,
                    tuple(members),
                    first.block_size,
                    sum(pages),
                    first.sliding_window,
                    first.attention_chunk_size,
                    layer_page_bytes=pages,
                    layer_true_page_bytes=tuple(
                        specs[i].true_page_bytes or specs[i].page_bytes for i in members
                    ),
                    prefix_cacheable=first.prefix_cacheable,
                )
            )
    return tuple(groups)
