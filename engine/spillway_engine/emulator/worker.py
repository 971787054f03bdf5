"""``EmulatedGpuWorker``: vLLM 0.33.0's worker interface, with no weights and no forward pass.

What it does, step by step (the GPU worker's duties, emulated):

* ``init_device``: the distributed groups on gloo (one rank per process, as on a GPU).
* ``load_model``: the real model class built on the meta device, so vLLM's own layers
  register in the forward context; each attention layer is then given the plan's
  backend (:mod:`.backends`) so block sizes and specs are the planned GPU's.
* ``determine_available_memory``: the emulated budget (``SPILLWAY_EMULATE_KV_BYTES``).
* ``initialize_from_config``: the KV connector's worker side, then vLLM's own
  ``allocate_kv_cache`` on the CPU, registered with the connector as on a GPU -- so
  Spillway's offloader copies real bytes between these tensors and its host pool.
* ``execute_model``: per scheduled token a signature of the prefix it ends (a rolling
  hash of the previous position's signature, read back from the KV pages, the token id
  and its position) is written into its slot of every attention layer's page. Each
  sampled token is a function of every signature its attention would read (the whole
  context of a full-attention layer, the window of a sliding one). A page that holds
  other bytes than recomputation would have written (a bad host load, a wrong prefix
  hit) therefore changes the output; it is also compared with the signature the
  tokens imply, and each differing (layer, position) is logged and counted
  (``spillway_emulator_kv_mismatch_total``, through the connector's stats). With
  ``SPILLWAY_EMULATE_SPEED`` > 0 the step then lasts as long as :mod:`.latency`
  estimates for the planned GPU (times that factor).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import get_model_architecture
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    group_kernel_blocks,
)
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase
from vllm.v1.worker.workspace import init_workspace_manager

from spillway_engine.emulator import ENV_MODEL_PARAMS, ENV_SPEED
from spillway_engine.emulator.backends import give_planned_backends, layer_kv_cache_specs
from spillway_engine.emulator.latency import (
    GPU_PROFILES,
    ModelCost,
    gpu_profile,
    parse_params,
    parse_speed,
    sleep_for,
    step_s,
)
from spillway_engine.emulator.platform import kv_budget_bytes, planned_gpu
from spillway_engine.metrics import EMULATOR_KV_MISMATCH

# Under vLLM's logger, so its handlers print it in the engine log.
logger = logging.getLogger("vllm.spillway.emulator")

_MASK = (1 << 64) - 1
_SEED = 0x5BD1E9955BD1E995
#: Shortest dummy step of an idle data-parallel rank (see execute_dummy_batch).
_IDLE_STEP_FLOOR_S = 0.001


def mix64(*values: int) -> int:
    """splitmix64 over the values: a cheap, well-spread 64-bit hash."""
    h = _SEED
    for v in values:
        h = (h ^ (v & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h


class _NoCudaStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event`` while the model is built: some
    model classes (DeepSeek-V4's, Kimi-Linear's) create side streams in ``__init__`` to
    overlap kernels at run time; with no forward pass they are never used, and without
    a CUDA driver creating one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def cuda_streams_stood_in() -> Iterator[None]:
    """Build a model on a CPU whose class creates CUDA side streams (also the contract
    harness's)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.Stream, torch.cuda.Event
    torch.cuda.Stream, torch.cuda.Event = _NoCudaStream, _NoCudaStream  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.Event = saved  # type: ignore[misc]


@dataclass
class _Pages:
    """One attention layer's pages as bytes: ``pages[block, slot * slot_bytes:...]``."""

    group: int
    salt: int
    block_size: int
    slot_bytes: int
    pages: np.ndarray  # uint8 (num_blocks, page_bytes), strided like the KV tensor
    window: int | None = None  # sliding window (tokens a query sees, itself included)
    local_chunk: int | None = None  # chunked-local attention: the chunk a query sees

    def first_visible(self, end: int) -> int:
        """First position the query at ``end - 1`` attends to in this layer. vLLM frees
        the blocks before it (they may hold another request's bytes by then)."""
        if self.window:
            return max(0, end - self.window)
        if self.local_chunk:
            return (end - 1) // self.local_chunk * self.local_chunk
        return 0

    def visible(self, blocks: list[int], end: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, raw signature words) the query at ``end - 1`` reads."""
        pos = np.arange(self.first_visible(end), end, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        idx = pos // self.block_size
        pos, idx = pos[idx < len(table)], idx[idx < len(table)]
        ids = table[idx]
        pos, ids = pos[ids != 0], ids[ids != 0]  # 0: the null block
        offsets = (pos % self.block_size) * self.slot_bytes
        raw = self.pages[ids[:, None], offsets[:, None] + np.arange(8)]
        return pos, np.ascontiguousarray(raw).view("<u8").ravel()

    def read(self, block: int, slot: int) -> int:
        off = slot * self.slot_bytes
        return int.from_bytes(self.pages[block, off : off + 8].tobytes(), "little")

    def write(self, block: int, slot: int, value: int) -> None:
        off = slot * self.slot_bytes
        self.pages[block, off : off + 8] = np.frombuffer(value.to_bytes(8, "little"), np.uint8)


@dataclass
class _Request:
    tokens: list[int]
    blocks: list[list[int]]
    computed: int = 0
    # The signature of each position as recomputation writes it: a function of the
    # tokens alone, so the reference any page read is checked against.
    expected: list[int] = field(default_factory=list)
    # A mismatch was counted: every later position derives from it, so it is the
    # one cause reported for this request (until it is rescheduled from scratch).
    poisoned: bool = False


class EmulatedGpuWorker(WorkerBase):
    """A GPU worker stand-in for ``--worker-cls`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layers: dict[str, Any] = {}
        self._pages: list[_Pages] = []
        self._requests: dict[str, _Request] = {}
        self._kv_cache_config: Any = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._vocab = 0
        self._avoid: set[int] = set()
        # Read once: a bad value fails the start-up, not the first request.
        self._speed = parse_speed(os.environ.get(ENV_SPEED))
        self._gpu = gpu_profile(planned_gpu()["name"])
        self._cost = ModelCost()
        # KV-cache group -> (tokens per block, bytes per token over its layers)
        self._group_kv: dict[int, tuple[int, int]] = {}
        # Counted since the last step's connector stats; None until the first report,
        # which sends 0 so the series is exported before anything goes wrong.
        self._mismatches: int | None = None
        # Pipeline parallelism: the step's output waits for sample_tokens (below).
        self._pipelined = self.parallel_config.pipeline_parallel_size > 1
        self._pending: ModelRunnerOutput | None = None

    # ---------------------------------------------------------------- start-up

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            backend="gloo",
        )
        # As the GPU worker does before it builds the model: sparse MLA's impl
        # (DeepSeek-V3.2, GLM-5) reserves its prefill workspace when a layer is built.
        init_workspace_manager(self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        vc = self.vllm_config
        with set_current_vllm_config(vc):
            model_cls, _ = get_model_architecture(vc.model_config)
            with torch.device("meta"), cuda_streams_stood_in():
                self.model = model_cls(vllm_config=vc, prefix="")
        self._layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
        gpu = planned_gpu()
        give_planned_backends(
            self._layers,
            gpu["attention_backend"],
            gpu["name"],
            bool(vc.cache_config.enable_prefix_caching),
            gpu["gdn_prefill_kernel"],
        )
        self._vocab = vc.model_config.get_vocab_size()
        eos = getattr(vc.model_config.hf_text_config, "eos_token_id", None)
        self._avoid = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._cost = self._model_cost()
        logger.info(
            "Emulated GPU %s: %s built on the meta device, %d cache layers on %s",
            gpu["name"],
            model_cls.__name__,
            len(self._layers),
            gpu["attention_backend"],
        )

    def _model_cost(self) -> ModelCost:
        """This rank's parameters and weight bytes, counted on the meta model (vLLM's
        layers are already tensor-parallel shards), unless SPILLWAY_EMULATE_MODEL_PARAMS
        names a size to time by (kept at the model's bytes per parameter)."""
        params = sum(p.numel() for p in self.model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        per_param = nbytes / params if params else 2.0
        override = parse_params(os.environ.get(ENV_MODEL_PARAMS))
        cost = ModelCost.of(override or params or 1, per_param)
        if self._speed > 0:
            known = planned_gpu()["name"] in GPU_PROFILES
            logger.info(
                "Emulated step times: %s profile%s, %.3g parameters per GPU (%s), "
                "weight_bytes=%.6g, x%g",
                self._gpu.name,
                "" if known else f" (no profile for {planned_gpu()['name']})",
                cost.params,
                ENV_MODEL_PARAMS if override else "counted",
                cost.weight_bytes,
                self._speed,
            )
        return cost

    def get_model(self) -> Any:
        return self.model

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return layer_kv_cache_specs(self.vllm_config, self._layers)

    def determine_available_memory(self) -> int:
        return kv_budget_bytes()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if kv_cache_config.kv_cache_layout is not None:
            record_kv_cache_layout(self.cache_config, kv_cache_config.kv_cache_layout)
        self.cache_config.hash_block_size = kv_cache_config.hash_block_size
        self.cache_config.cache_hit_alignment_tokens = kv_cache_config.cache_hit_alignment_tokens
        # Before the caches exist, as GPUModelRunner does: the connector's worker
        # side is built from the config, then handed the tensors.
        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._kv_caches = allocate_kv_cache(
            kv_cache_config, self.device, self.cache_config.get_resolved_kv_cache_layout()
        )
        self._group_kv = {}
        self._pages = self._page_views(kv_cache_config, self._kv_caches)
        if has_kv_transfer_group():
            get_kv_transfer_group().register_kv_caches(self._kv_caches)

    def _page_views(self, cfg: Any, kv_caches: dict[str, torch.Tensor]) -> list[_Pages]:
        """Per attention layer, its (num_blocks, page) bytes -- the connector's view."""
        out = []
        for g, group in enumerate(cfg.kv_cache_groups):
            spec = group.kv_cache_spec
            per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
            for name in group.layer_names:
                layer_spec = per_layer.get(name, spec)
                if not isinstance(layer_spec, AttentionSpec) or name not in kv_caches:
                    continue  # Mamba state has no per-token slots
                ref = group_kernel_blocks(kv_caches[name], cfg.num_blocks)
                page = layer_spec.page_size_bytes
                slot = layer_spec.unpadded_page_size_bytes // layer_spec.block_size
                if slot < 8:
                    continue
                flat = torch.empty(0, dtype=torch.uint8).set_(
                    ref.untyped_storage(),
                    ref.storage_offset() * ref.element_size(),
                    (cfg.num_blocks, page),
                    (ref.stride(0) * ref.element_size(), 1),
                )
                salt = mix64(len(out), 0xA5)  # a layer-specific mask: every layer counts
                window = (
                    layer_spec.sliding_window if isinstance(layer_spec, SlidingWindowSpec) else None
                )
                local = (
                    layer_spec.attention_chunk_size
                    if isinstance(layer_spec, ChunkedLocalAttentionSpec)
                    else None
                )
                out.append(
                    _Pages(g, salt, layer_spec.block_size, slot, flat.numpy(), window, local)
                )
                size, per_token = self._group_kv.get(g, (layer_spec.block_size, 0))
                self._group_kv[g] = (size, per_token + slot)
        return out

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_kv_connector_handshake_metadata(self) -> Any:
        if not has_kv_transfer_group():
            return None
        metadata = get_kv_transfer_group().get_handshake_metadata()
        return None if metadata is None else {(0, self.rank): metadata}

    # --------------------------------------------------------------------- steps

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        """The step's output, or -- under pipeline parallelism, when tokens were
        scheduled -- None, the output kept for :meth:`sample_tokens`.

        With pipeline stages vLLM's engine core runs a batch queue that always asks
        ``sample_tokens`` after a step with tokens, and the executor gathers every
        stage's answer (each stage's KV-connector output; the tokens are the last
        stage's). Each stage writes and checks only its own layers' pages; no hidden
        states pass between stages, since the emulated tokens come from the KV bytes.
        """
        output = self._execute(scheduler_output)
        if self._pipelined and scheduler_output.total_num_scheduled_tokens:
            self._pending = output
            return None
        return output

    def _execute(self, scheduler_output: Any) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_requests(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            if not has_kv_transfer_group():
                return EMPTY_MODEL_RUNNER_OUTPUT
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(
                scheduler_output, self.vllm_config
            )
        req_ids = list(scheduler_output.num_scheduled_tokens)
        with (
            set_forward_context(None, self.vllm_config),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(
                scheduler_output
            ) as kv_connector_output,
        ):
            sampled = [
                self._run(rid, scheduler_output.num_scheduled_tokens[rid]) for rid in req_ids
            ]
            if self._speed > 0:
                # Inside the connector's context, as the GPU's forward pass: its loads
                # and stores overlap the step.
                self._sleep_out_step(scheduler_output, t0)
        if kv_connector_output is not None and self._mismatches != 0:
            # The connector's stats reach vLLM's /metrics in the API server.
            stats = kv_connector_output.kv_connector_stats or OffloadingConnectorStats()
            stats.increase_counter(EMULATOR_KV_MISMATCH.name, self._mismatches or 0)
            kv_connector_output.kv_connector_stats = stats
            self._mismatches = 0
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_connector_output,
        )

    def _kv_bytes_read(self, rid: str, num_tokens: int) -> int:
        """Bytes of KV this request's attention reads in the step: its context in every
        layer, less the null blocks a sliding window has dropped."""
        req = self._requests[rid]
        end = req.computed + num_tokens
        total = 0
        for g, (block_size, slot_bytes) in self._group_kv.items():
            blocks = req.blocks[g][: -(-end // block_size)]
            total += max(0, end - blocks.count(0) * block_size) * slot_bytes
        return total

    def _sleep_out_step(self, out: Any, t0: float) -> None:
        kv = sum(self._kv_bytes_read(rid, n) for rid, n in out.num_scheduled_tokens.items())
        modelled = step_s(out.total_num_scheduled_tokens, self._gpu, self._cost, kv)
        pause = sleep_for(modelled, self._speed, time.perf_counter() - t0)
        if pause > 0:
            time.sleep(pause)

    def execute_dummy_batch(self) -> None:
        # Under data parallelism an idle engine runs a one-token step while another rank
        # is busy, so the MoE collectives of a wave stay in step. The emulated model has
        # no collectives: only the step's modelled time passes (at least 1 ms, so the
        # idle rank does not spin a CPU core the busy one needs).
        modelled = sleep_for(step_s(1, self._gpu, self._cost), self._speed)
        time.sleep(max(modelled, _IDLE_STEP_FLOOR_S))

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | None:
        # Without pipeline stages execute_model already answered with the tokens.
        output, self._pending = self._pending, None
        return output

    def take_draft_token_ids(self) -> None:
        return None

    def _update_requests(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self._requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self._requests[new.req_id] = _Request(
                tokens=list(new.prompt_token_ids or []),
                blocks=[list(b) for b in new.block_ids],
                computed=new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self._requests[rid]
            if rid in cached.all_token_ids:
                req.tokens = list(cached.all_token_ids[rid])
            elif cached.new_token_ids:
                # Pipeline parallelism: the scheduler sends the tokens the step computes,
                # the last stage's samples (an earlier stage appended its own guesses)
                start = cached.num_computed_tokens[i]
                new = list(cached.new_token_ids[i])
                req.tokens[start : start + len(new)] = new
                del req.expected[start:]
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                req.blocks = [list(b) for b in new_blocks or ()]
                req.poisoned = False  # new blocks: a fresh check
            elif new_blocks is not None:
                for blocks, more in zip(req.blocks, new_blocks, strict=True):
                    blocks.extend(more)
            req.computed = cached.num_computed_tokens[i]

    def _slot(self, req: _Request, pages: _Pages, pos: int) -> tuple[int, int] | None:
        blocks = req.blocks[pages.group]
        idx = pos // pages.block_size
        if idx >= len(blocks) or blocks[idx] == 0:  # 0: the null block (outside a window)
            return None
        return blocks[idx], pos % pages.block_size

    def _read(self, req: _Request, pos: int) -> int:
        """The signature the pages hold for ``pos``, folded over every layer."""
        h = _SEED
        for pages in self._pages:
            where = self._slot(req, pages, pos)
            if where is not None:
                h = mix64(h, pages.read(*where) ^ pages.salt)
        return h

    def _fold(self, signature: int) -> int:
        """What ``_read`` returns when every layer holds ``signature``."""
        h = _SEED
        for _ in self._pages:
            h = mix64(h, signature)
        return h

    def _expected(self, req: _Request, end: int) -> np.ndarray:
        """Signatures of positions ``0..end-1`` as recomputation writes them."""
        sigs = req.expected
        while len(sigs) < end:
            pos = len(sigs)
            prev = self._fold(sigs[-1]) if sigs else _SEED
            sigs.append(mix64(prev, req.tokens[pos], pos))
        return np.asarray(sigs[:end], dtype=np.uint64)

    def _attend(self, rid: str, req: _Request, start: int, end: int) -> int:
        """A digest of every signature the query at ``end - 1`` reads, over all layers.

        Each page slot before ``start`` (written by earlier steps or reused from a
        cache, not by this step) that differs from recomputation is logged and counted.
        """
        expected = self._expected(req, end)
        digest = _SEED
        wrong: list[tuple[int, np.ndarray]] = []
        for layer, pages in enumerate(self._pages):
            pos, raw = pages.visible(req.blocks[pages.group], end)
            if not len(pos):
                continue
            words = raw ^ np.uint64(pages.salt)
            weights = (2 * pos + 1).astype(np.uint64)  # position-dependent, odd
            digest = mix64(digest, int(np.bitwise_xor.reduce(words * weights)))
            bad = pos[(words != expected[pos]) & (pos < start)]
            if len(bad):
                wrong.append((layer, bad))
        if wrong and not req.poisoned:
            req.poisoned = True
            for layer, bad in wrong:
                self._mismatches = (self._mismatches or 0) + len(bad)
                logger.warning(
                    "Emulated KV mismatch: request %s, layer %d (KV-cache group %d): %d "
                    "position(s) differ from recomputation, first %d",
                    rid,
                    layer,
                    self._pages[layer].group,
                    len(bad),
                    int(bad[0]),
                )
        return digest

    def _run(self, rid: str, num_tokens: int) -> list[int]:
        req = self._requests[rid]
        start = req.computed
        prev = self._read(req, start - 1) if start > 0 else _SEED
        for pos in range(start, start + num_tokens):
            signature = mix64(prev, req.tokens[pos], pos)
            for pages in self._pages:
                where = self._slot(req, pages, pos)
                if where is not None:
                    pages.write(*where, signature ^ pages.salt)
            prev = self._fold(signature)
        end = start + num_tokens
        if end < len(req.tokens):
            return []  # a prefill chunk that does not reach the last token
        token = mix64(self._read(req, end - 1), self._attend(rid, req, start, end)) % self._vocab
        while token in self._avoid:
            token = (token + 1) % self._vocab
        req.tokens.append(token)
        return [token]

    # ----------------------------------------------------------------- the rest

    def check_health(self) -> None:
        return

    def reset_mm_cache(self) -> None:
        return

    def reset_encoder_cache(self) -> None:
        return

    def add_lora(self, lora_request: Any) -> bool:
        return False

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if has_kv_transfer_group():
            get_kv_transfer_group().shutdown()
        self._pages = []
        self._kv_caches = {}
