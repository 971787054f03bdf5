"""vLLM's real engine loop on the CPU, with only the model's forward pass stood in for.

vLLM 0.33.0's ``Scheduler`` (with its KV-cache manager, prefix cache and the KV
connector's scheduler side) plans every step; the connector's worker side
(``OffloadingConnectorWorker`` + the spec's worker) runs the transfers it asks for.
The forward pass is replaced by a page writer: after a step, every GPU block a
request computed holds bytes derived from (layer, the token prefix ending at the
block), so any block can be checked later, byte for byte, against what the model
would have written. The "GPU" KV caches are CPU tensors laid out as vLLM allocates
them: one tensor per ``KVCacheTensor``, shared by one layer of each group.

``move_bytes=False`` skips the worker (transfers are acknowledged at once): the
scheduler-side geometry, keys, hits and capacity are still vLLM's and the
connector's own, which is what the offload-capacity benchmark compares for
upstream's connector (whose worker needs CUDA).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import KVTransferConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from spillway_engine.offloader import register_connector
from spillway_engine.offloader.geometry import unpadded_page_bytes

from .conftest import load_model
from .vllm_harness import Case, build_layout

UPSTREAM = "OffloadingConnector"
SPILLWAY = "SpillwayOffloadingConnector"
#: Page patterns repeat with a prime period, so a shifted copy never matches.
PATTERN = 4093


def shrunk_config(name: str, layers: int) -> dict[str, Any]:
    """A real config.json with fewer layers; its KV-group structure stays the same."""
    config = copy.deepcopy(load_model(name))
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    return config


def gemma4_style_config() -> dict[str, Any]:
    """Full layers with twice the sliding layers' head size: vLLM gives the sliding
    groups 32-token blocks and the full group 16-token ones (mixed block sizes)."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(
        num_hidden_layers=6,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=256,
        per_layer_config={"05": {"head_dim": 256}},
        vocab_size=32000,
        vocab_size_per_layer_input=32000,
        hidden_size_per_layer_input=64,
    ).to_dict()
    config["architectures"] = ["Gemma4ForCausalLM"]
    return config


@dataclass
class LoopCounters:
    steps: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    loaded_blocks: int = 0
    checked_blocks: int = 0
    #: prompt tokens served from the GPU prefix cache / loaded from the host / computed
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    #: host hits since the start (host_hit_tokens may be reset between phases)
    all_host_hit_tokens: int = 0
    prompt_tokens: int = 0
    loaded_block_ids: list[tuple[int, int]] = field(default_factory=list)


class EngineLoop:
    """One engine: vLLM's scheduler and the connector on both sides, on the CPU."""

    def __init__(
        self,
        model_config: dict[str, Any],
        case: Case,
        backend: str | None,
        *,
        connector: str = SPILLWAY,
        extra: dict[str, Any] | None = None,
        move_bytes: bool = True,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 4096,
        kv_events: bool = False,
    ):
        register_connector()
        layout = build_layout(model_config, case, backend)
        vc = layout.vllm_config
        kv = layout.kv_cache_config
        self.kv_cache_config = kv
        self.vllm_config = vc
        vc.kv_transfer_config = KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra or {"cpu_bytes_to_use": 1 << 28}),
        )
        vc.cache_config.num_gpu_blocks = kv.num_blocks
        if kv_events:
            vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        vc.scheduler_config.max_num_seqs = max_num_seqs
        vc.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
        # EngineCore hands the scheduler a copy whose mixed-page groups
        # (UniformTypeKVCacheSpecs) carry one layer's spec: no block manager takes the
        # aggregate (DeepSeek-V3.2's latents + indexer keys, a draft model's layers).
        scheduler_kv = generate_scheduler_kv_cache_config([kv])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv, vc)
        kv.hash_block_size = scheduler_kv.hash_block_size = hash_block_size
        self.scheduler = Scheduler(
            vc,
            scheduler_kv,
            StructuredOutputManager(vc),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(
            hash_block_size, hash_fn, vc.num_hash_lookahead_tokens
        )
        self.connector = self.scheduler.connector
        #: the KV events the engine core published (GPU and host tier), in order
        self.kv_events: list[Any] = []
        if kv_events:
            publisher = self.scheduler.kv_event_publisher
            publish = publisher.publish

            def record(batch: Any) -> None:
                self.kv_events.extend(batch.events)
                publish(batch)

            publisher.publish = record
        self.move_bytes = move_bytes
        self.counters = LoopCounters()
        #: the connector stats payloads the engine core sent, step by step
        self.stats_payloads: list[dict[str, Any]] = []
        self._requests: dict[str, Request] = {}
        self._next_id = 0
        self._layer_spec: dict[str, Any] = {}
        self._layer_group: dict[str, int] = {}
        for gid, group in enumerate(kv.kv_cache_groups):
            spec = group.kv_cache_spec
            for name in group.layer_names:
                self._layer_spec[name] = (
                    spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
                )
                self._layer_group[name] = gid
        if move_bytes:
            self._init_worker()

    # ------------------------------------------------------------------ set-up

    def _init_worker(self) -> None:
        kv = self.kv_cache_config
        self.worker_connector = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, kv
        )
        n = kv.num_blocks
        # One backing allocation; each KVCacheTensor places some layers in it (groups
        # overlay each other: a block id belongs to one group at a time).
        backing = torch.zeros(kv.kv_cache_tensors[0].size, dtype=torch.int8)
        self.tensors = []
        self._layer_tensor = {}
        for placement in kv.kv_cache_tensors:
            for index, name in enumerate(placement.layers):
                page = self._layer_spec[name].page_size_bytes
                view = torch.as_strided(
                    backing,
                    (n, page),
                    (placement.block_stride, 1),
                    placement.offset + index * placement.layer_stride,
                )
                self._layer_tensor[name] = len(self.tensors)
                self.tensors.append(view)
        self._backing = backing
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_offloading_group_ids,
        )

        self.offloaded_groups = list(get_offloading_group_ids(kv))
        refs = [
            [
                CanonicalKVCacheRef(
                    self._layer_tensor[name], unpadded_page_bytes(self._layer_spec[name])
                )
                for name in kv.kv_cache_groups[gid].layer_names
            ]
            for gid in self.offloaded_groups
        ]
        canonical = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors], refs
        )
        self.worker_connector.connector_worker._init_worker(canonical)

    # --------------------------------------------------------------- requests

    def add_request(self, prompt: Sequence[int], max_tokens: int = 2) -> str:
        req_id = f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self._requests[req_id] = request
        self.scheduler.add_request(request)
        self.counters.prompt_tokens += len(prompt)
        return req_id

    def run(self, prompts: Iterable[Sequence[int]], max_tokens: int = 2) -> None:
        """Serve ``prompts`` one after another (each to completion)."""
        for prompt in prompts:
            self.add_request(prompt, max_tokens)
            self.drain()

    def drain(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                # finished requests may still have stores queued for the next step
                self.step()
                self.step()
                return
            self.step()
        raise AssertionError("the engine loop did not finish")

    # ------------------------------------------------------------------- step

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.counters.steps += 1
        meta = out.kv_connector_metadata
        self._collect_hit_stats()
        worker_meta = None
        finished_recving: set[str] = set()
        if meta is not None:
            self.counters.load_jobs += len(meta.load_jobs)
            self.counters.store_jobs += len(meta.store_jobs)
            if self.move_bytes:
                wc = self.worker_connector
                wc.bind_connector_metadata(meta)
                wc.handle_preemptions(meta)
                wc.start_load_kv(None)
                for job in meta.load_jobs.values():
                    self._check_loaded(job.req_id, job.dst_spec)
            else:
                worker_meta = OffloadingWorkerMetadata()
                for job_id in (*meta.load_jobs, *meta.store_jobs):
                    worker_meta.mark_completed(job_id)
                worker_meta.completed_jobs = {
                    j: self.scheduler.parallel_config.world_size for j in worker_meta.completed_jobs
                }
                finished_recving = {j.req_id for j in meta.load_jobs.values() if not j.sync}
        if self.move_bytes:
            self._apply_copies(out)
            self._forward(out)
        sampled: dict[str, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            request = self._requests[req_id]
            # (schedule() already advanced num_computed_tokens by this step's tokens)
            done = request.num_computed_tokens >= request.num_prompt_tokens
            sampled[req_id] = [self._next_token(request)] if done else []
        if self.move_bytes and meta is not None:
            wc = self.worker_connector
            wc.wait_for_save()
            _, finished_recving = wc.get_finished(out.finished_req_ids)
            worker_meta = wc.build_connector_worker_meta()
            wc.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving or None,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        for outputs in self.scheduler.update_from_output(out, output).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.stats_payloads.append(stats.kv_connector_stats)

    def _collect_hit_stats(self) -> None:
        gpu = self.scheduler.kv_cache_manager.make_prefix_cache_stats()
        if gpu is not None:
            self.counters.gpu_hit_tokens += gpu.hits
        host = self.scheduler.connector_prefix_cache_stats
        if host is not None:
            self.counters.host_hit_tokens += host.hits
            self.counters.all_host_hit_tokens += host.hits
            host.hits = 0

    @staticmethod
    def _next_token(request: Request) -> int:
        return (sum(request.all_token_ids[-8:]) * 7919 + 13) % 30000 + 100

    # ------------------------------------------------------------ fake forward

    def _pattern(self, layer: str, tokens: Sequence[int], page: int) -> torch.Tensor:
        digest = hashlib.blake2b(
            np.asarray(tokens, dtype=np.int64).tobytes() + layer.encode(), digest_size=8
        ).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        base = rng.integers(-128, 128, size=min(PATTERN, page), dtype=np.int8)
        return torch.from_numpy(np.resize(base, page))

    def _group_blocks(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def _block_tokens(self, gid: int) -> int:
        return self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size

    def _expected(self, name: str, request: Request, index: int, end: int) -> torch.Tensor:
        page = unpadded_page_bytes(self._layer_spec[name])
        return self._pattern(name, request.all_token_ids[:end], page)

    def _apply_copies(self, out: Any) -> None:
        for block_copy in out.kv_cache_block_copies or ():
            for t in self.tensors:
                t[block_copy.dst_block_id].copy_(t[block_copy.src_block_id].clone())

    def _forward(self, out: Any) -> None:
        """Write every block the scheduled tokens touch, as the model would."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self._requests[req_id]
            stop = request.num_computed_tokens  # already advanced by schedule()
            start = stop - n
            blocks = self._group_blocks(req_id)
            for gid in self.offloaded_groups:
                tpb = self._block_tokens(gid)
                for index in range(start // tpb, -(-stop // tpb)):
                    if index >= len(blocks[gid]) or blocks[gid][index] == 0:
                        continue
                    end = min((index + 1) * tpb, stop)
                    for name in self.kv_cache_config.kv_cache_groups[gid].layer_names:
                        page = self._expected(name, request, index, end)
                        row = self.tensors[self._layer_tensor[name]][blocks[gid][index]]
                        row[: page.numel()].copy_(page)

    def _check_loaded(self, req_id: str, spec: GPULoadStoreSpec) -> None:
        """Loaded blocks hold exactly what the model wrote for those tokens."""
        request = self._requests[req_id]
        ids = spec.block_ids.tolist()
        expansion = getattr(self.connector, "_expansion", {})
        start = 0
        for gid, size, first in zip(
            self.offloaded_groups, spec.group_sizes, spec.block_indices, strict=True
        ):
            m = expansion.get(gid, 1)
            tpb = self._block_tokens(gid)
            for k in range(0, size, m):
                block_id, index = ids[start + k], (first + k) // m
                self.counters.loaded_block_ids.append((gid, block_id))
                for name in self.kv_cache_config.kv_cache_groups[gid].layer_names:
                    want = self._expected(name, request, index, (index + 1) * tpb)
                    got = self.tensors[self._layer_tensor[name]][block_id][: want.numel()]
                    if not torch.equal(got, want):
                        raise AssertionError(
                            f"request {req_id}: group {gid} block {index} (id {block_id}), "
                            f"layer {name}: loaded bytes differ from the computed ones"
                        )
                self.counters.checked_blocks += 1
                self.counters.loaded_blocks += 1
            start += size

    # ------------------------------------------------------------------ facts

    @property
    def connector_is_spillway(self) -> bool:
        return hasattr(self.connector, "geometry")

    @property
    def manager(self) -> Any:
        return self.connector.connector_scheduler.manager
