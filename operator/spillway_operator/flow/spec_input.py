"""What the spec's fields accept: patterns, bounds and reserved names.

Shared by the pydantic model (``flow.spec``), which the operator parses every object
with, and the CEL rules (``flow.cel``) the API server runs at apply, so both refuse
the same input with the same words.
"""

from __future__ import annotations

import re
from decimal import Decimal

from spillway_engine.seam import DIST_PORT, ENGINE_PORT

# A Kubernetes resource quantity ("64Gi", "500M", "1.5Ti", "123456").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
#: CPU quantities also come in millicores ("250m"), which memory sizes never need.
CPU_PATTERN = r"^([0-9]+m|[0-9]+(\.[0-9]+)?(k|M|G|T|P|E)?)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Upper bounds on the spec's quantities, far beyond any node (the largest hold tens of
#: TiB and a few thousand CPUs): a typo such as 99999999999999999999Ei is refused by
#: field at apply, rather than planned into pod sizes no API server can store.
MAX_MEMORY = "1Pi"
MAX_CPU = "65536"


def cpu_cores(value: str) -> Decimal:
    if value.endswith("m"):
        return Decimal(value[:-1]) / 1000
    number = re.match(r"[0-9.]+", value).group()
    return Decimal(number) * 1000 ** " kMGTPE".index(value[len(number):] or " ")


def at_most(value: str | None, maximum: str, parse) -> str | None:
    if value is not None and value != "auto" and parse(value) > parse(maximum):
        raise ValueError(f"{value} is more than {maximum}, beyond any node")
    return value


# A Hugging Face repo id, as huggingface_hub's validate_repo_id accepts it (ASCII):
# "name" or "namespace/name", each part word characters joined by '-' and '.' with
# no "--" or ".." (so separators alternate), starting and ending with a word
# character. Each part's 96-character limit and the ".git" ending are CEL rules.
_WORD = "[A-Za-z0-9_]+"
_SEPARATOR = r"(-(\.-)*\.?|\.(-\.)*-?)"
_REPO_PART = f"{_WORD}({_SEPARATOR}{_WORD})*"
MODEL_ID_PATTERN = f"^({_REPO_PART}/)?{_REPO_PART}$"
MODEL_ID_PART_MAX = 96


def model_id_problem(name: str) -> str | None:
    """What the hub refuses in a model id that the pattern lets through, if anything."""
    if any(len(part) > MODEL_ID_PART_MAX for part in name.split("/")):
        return f"each part of a model id is at most {MODEL_ID_PART_MAX} characters"
    if name.endswith(".git"):
        return "a model id cannot end in .git"
    return None


# Container env the engine or the operator owns, or that changes what the engine
# runs (its plugins, its Python path, its GPUs): refused in engine.env.
RESERVED_ENV_PREFIXES = ("SPILLWAY_",)
RESERVED_ENV_NAMES = (
    "HF_HOME",  # the operator's model cache volume
    "HF_TOKEN",  # model.tokenSecretRef
    "HUGGING_FACE_HUB_TOKEN",
    "VLLM_PLUGINS",  # Spillway's plugin must load
    "VLLM_ATTENTION_BACKEND",  # the planned block sizes follow the planned backend
    "CUDA_VISIBLE_DEVICES",  # the GPUs the plan was sized for
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
)


#: vLLM's own variables (vllm/envs.py of 0.33.0) that change what the plan assumed:
#: refused in engine.env with what they change and the spec field the plan follows, as
#: a pod started with one would serve other than planned (its pages, stages or ranks).
PLAN_ENV_OWNERS: dict[str, tuple[str, str]] = {
    # vLLM's default split, or the plan's own, which the launcher exports
    "VLLM_PP_LAYER_PARTITION": ("the layers each pipeline stage holds",
                                "engine.pipelineParallelSize"),
    # read by vLLM when its data-parallel size is 1 (offline SPMD): ranks never planned
    **dict.fromkeys(
        ("VLLM_DP_SIZE", "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_DP_MASTER_IP",
         "VLLM_DP_MASTER_PORT"), ("the data-parallel ranks", "engine.dataParallelSize")),
    # full keys and values instead of MLA's latent: pages many times the planned ones
    "VLLM_MLA_DISABLE": ("the KV cache of MLA models", "model.name (its config.json)"),
}


def env_owner_message(name: str) -> str | None:
    """Why engine.env may not set ``name`` (a variable the plan depends on), or None."""
    if name not in PLAN_ENV_OWNERS:
        return None
    what, field = PLAN_ENV_OWNERS[name]
    return f"{name} is refused: it changes {what}, which the plan follows from spec.{field}"


def reserved_env(name: str) -> bool:
    return name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV_NAMES

DISK_CLAIM_MESSAGE = "offload.disk.claimName is required with volume SharedPVC, and only then"
DISK_CLASS_MESSAGE = "offload.disk.storageClassName is only for volume Ephemeral"


#: What engine.kvEvents.port may not be, with the rank offsets (flow.cel repeats it).
EVENT_PORTS_MESSAGE = (
    f"engine.kvEvents.port + dataParallelSize - 1 must be at most 65535, and the range "
    f"may not hold the serving port {ENGINE_PORT} or the rendezvous port {DIST_PORT}"
)


def event_ports_problem(port: int, data_parallel_size: int) -> str | None:
    """Why the KV-event ports ``port .. port + dp - 1`` cannot be the pod's, or None."""
    last = port + data_parallel_size - 1
    if last > 65535 or port <= ENGINE_PORT <= last or port <= DIST_PORT <= last:
        return f"{EVENT_PORTS_MESSAGE} (got {port}..{last})"
    return None
