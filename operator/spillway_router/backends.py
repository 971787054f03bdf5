"""The pods the router sends to, and what their plans say about them (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .scoring import CostModel


@dataclass(frozen=True)
class Profile:
    """What routing needs from a pod's plan."""

    tokens_per_hash: int = 16
    max_model_len: int | None = None
    #: host tier capacity in tokens (the plan's capacity_tokens)
    host_capacity_tokens: int = 0
    #: KV bytes of one token in the host tier, every group (row bytes / tokens per chunk)
    host_bytes_per_token: float = 0.0
    #: a group keyed at every k-th hash leaves k-1 unheld hashes between held ones
    gap: int = 1
    #: host-tier events without per-block hashes carry one key per chunk
    host_gap: int = 1
    #: disk tier capacity in tokens per engine (the plan's disk.capacity_tokens; 0: none)
    disk_capacity_tokens: int = 0
    #: KV bytes of one token in a disk chunk file (chunk set bytes / tokens per chunk)
    disk_bytes_per_token: float = 0.0
    #: the pods of one deployment share one disk folder (the plan's disk.writers > 1):
    #: the folder's identity (the plan's disk.cache_key; the kube watch qualifies it with
    #: the namespace and deployment); None: each pod's disk is its own
    disk_group: str | None = None


def profile_from_plan(plan: Any) -> Profile:
    """A :class:`Profile` from a ``spillway_engine.planner.plan.Plan`` (duck-typed, so
    this module needs no pydantic model)."""
    unit = int(plan.tokens_per_hash)
    tokens_per_chunk = plan.capacity_tokens / plan.num_chunks if plan.num_chunks else 0
    per_token = plan.row_bytes / tokens_per_chunk if tokens_per_chunk else 0.0
    # full attention is kept from the first block; windowed groups drop early blocks
    full = [
        g.tokens_per_block
        for g in plan.kv_groups
        if g.sliding_window is None and getattr(g, "attention_chunk_size", None) is None
    ]
    stride = min(full or [g.tokens_per_block for g in plan.kv_groups] or [unit])
    disk = getattr(plan, "disk", None)
    disk_fields: dict[str, Any] = {}
    if disk is not None:
        disk_chunk_tokens = disk.capacity_tokens / disk.num_chunks if disk.num_chunks else 0
        disk_fields = {
            "disk_capacity_tokens": int(disk.capacity_tokens),
            "disk_bytes_per_token": (
                float(disk.chunk_set_bytes / disk_chunk_tokens) if disk_chunk_tokens else
                float(per_token)
            ),
            "disk_group": str(disk.cache_key) if int(disk.writers) > 1 else None,
        }
    return Profile(
        tokens_per_hash=unit,
        max_model_len=int(plan.max_model_len),
        host_capacity_tokens=int(plan.capacity_tokens),
        host_bytes_per_token=float(per_token),
        gap=max(1, stride // unit),
        host_gap=max(1, int(tokens_per_chunk) // unit),
        **disk_fields,
    )


#: ``Backend.events``: ask the pod (``GET /kv_event_sources``) where its ranks publish
EVENTS_FROM_POD = "pod"


@dataclass(frozen=True)
class Backend:
    name: str
    model: str
    url: str  # http://host:port, no trailing slash
    events: str | None = None  # tcp://host:port of its KV event publisher, or "pod"
    profile: Profile = field(default_factory=Profile)
    draining: bool = False
    #: its GPU pool (``namespace/deployment/pool``; None: the object has no gpuPools),
    #: whose measured rate weighs it (rates.PoolRates)
    pool: str | None = None

    @property
    def address(self) -> str:
        """host:port, as a gateway names an endpoint."""
        return self.url.split("://", 1)[1]

    def cost(self, weight: float = 1.0, **flags: float) -> CostModel:
        """Its cost model; ``weight``: its pool's rate against the others' (a pod twice
        as fast prefills and clears its queue in half the time)."""
        p = self.profile
        for name in ("prefill_s_per_token", "wait_s_per_request"):
            if name in flags:
                flags[name] = flags[name] / weight
        return CostModel(
            tokens_per_hash=p.tokens_per_hash,
            host_bytes_per_token=p.host_bytes_per_token,
            disk_bytes_per_token=p.disk_bytes_per_token or None,
            **flags,
        )


class BackendSpecError(ValueError):
    pass


_KEYS = {"name", "model", "url", "events", "plan", "draining"}


def parse_backend_spec(spec: str) -> dict[str, str]:
    """``model=M,url=U[,name=N][,events=tcp://H:P|pod][,plan=PATH]`` (the --backend flag)."""
    out: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise BackendSpecError(f"--backend {spec!r}: {part!r} is not key=value")
        if key not in _KEYS:
            raise BackendSpecError(f"--backend {spec!r}: unknown key {key!r} (one of {_KEYS})")
        if key in out:
            raise BackendSpecError(f"--backend {spec!r}: {key} given twice")
        out[key] = value.strip()
    for need in ("model", "url"):
        if need not in out:
            raise BackendSpecError(f"--backend {spec!r}: {need}= is required")
    if not out["url"].startswith(("http://", "https://")):
        raise BackendSpecError(f"--backend {spec!r}: url must be http(s)://")
    events = out.get("events")
    if events is not None and events != EVENTS_FROM_POD and not events.startswith(
        ("tcp://", "ipc://")
    ):
        raise BackendSpecError(
            f"--backend {spec!r}: events must be tcp://, ipc:// or {EVENTS_FROM_POD} (ask the "
            "pod's /kv_event_sources)"
        )
    out["url"] = out["url"].rstrip("/")
    out.setdefault("name", out["url"].split("://", 1)[1])
    return out


def backend_from_spec(fields: dict[str, str], profile: Profile) -> Backend:
    return Backend(
        name=fields["name"],
        model=fields["model"],
        url=fields["url"],
        events=fields.get("events"),
        profile=profile,
        draining=fields.get("draining", "false").lower() == "true",
    )


def with_draining(backend: Backend, draining: bool) -> Backend:
    return replace(backend, draining=draining)
