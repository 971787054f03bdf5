"""Where a model's config.json comes from: a local file or directory, or the HF hub.

Only ``config.json`` is ever fetched (never weights). Hub downloads go through
``huggingface_hub`` and its cache, so repeated plans do not touch the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: A real config.json is a few KiB; anything past this is not one (a ConfigMap holds 1 MiB).
MAX_CONFIG_BYTES = 4 * 2**20
#: Real configs nest three or four levels (text_config.rope_scaling...); deep nesting is
#: hostile and would exhaust Python's recursion on the way in or out.
MAX_CONFIG_DEPTH = 64


class ModelConfigSourceError(ValueError):
    """The config could not be used: not found, refused, or not a config.json. The
    same source gives the same answer until someone changes it (the spec, the
    ConfigMap, the hub repository); the message says what to change."""


class ModelConfigUnreachable(ModelConfigSourceError):
    """The source did not answer (network, timeout, the hub's 5xx or 429): asking
    again later may succeed. Only transport failures are this; hostile content is
    refused wherever it comes from."""


def _depth(text: str) -> int:
    """Deepest nesting of JSON arrays/objects in ``text``, brackets in strings skipped."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_config_text(text: str, where: str) -> dict[str, Any]:
    if len(text) > MAX_CONFIG_BYTES:
        raise ModelConfigSourceError(
            f"{where} is {len(text)} bytes, more than a config.json can be "
            f"({MAX_CONFIG_BYTES} bytes at most)"
        )
    if _depth(text) > MAX_CONFIG_DEPTH:
        raise ModelConfigSourceError(
            f"{where} nests arrays/objects more than {MAX_CONFIG_DEPTH} levels deep; "
            "it is not a model config.json"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigSourceError(
            f"{where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigSourceError(f"{where} must hold a JSON object")
    # Spillway's own fixtures wrap the real config with provenance fields.
    if "config" in data and "architectures" not in data and isinstance(data["config"], dict):
        return data["config"]
    return data


def load_local(path: str | Path) -> dict[str, Any]:
    """A config.json file, or a model directory that contains one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelConfigSourceError(f"{p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigSourceError(f"cannot read {p}: {e}") from None
    return parse_config_text(text, str(p))


def load_hub(
    model_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model id, through the hub cache.
    ``endpoint``: another hub (a mirror); default ``HF_ENDPOINT``, else huggingface.co."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ModelConfigSourceError(f"huggingface_hub is not installed: {e}") from None
    try:
        path = hf_hub_download(
            model_id,
            "config.json",
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            endpoint=endpoint,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        # before EntryNotFoundError: the "not cached while offline" error subclasses it.
        # huggingface_hub also says "not cached" when the hub answered without its own
        # headers (a plain mirror's 404, a web server's 200): an answer, not silence.
        if (answer := _answer_without_hub_headers(e.__cause__)) is not None:
            raise ModelConfigSourceError(
                f"cannot fetch config.json of {model_id}: {answer}") from None
        raise ModelConfigUnreachable(
            f"cannot fetch config.json of {model_id}: the Hugging Face hub is unreachable "
            "(or HF_HUB_OFFLINE is set) and it is not in the local cache; use "
            "--model-config with a local file"
        ) from None
    except GatedRepoError:
        raise ModelConfigSourceError(
            f"{model_id} is gated: accept its licence on huggingface.co and pass a token (HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelConfigSourceError(
            f"model {model_id!r} was not found on the Hugging Face hub (or it is private "
            "and no token was given)"
        ) from None
    except RevisionNotFoundError:
        raise ModelConfigSourceError(f"{model_id}: revision {revision!r} not found") from None
    except EntryNotFoundError:
        raise ModelConfigSourceError(f"{model_id} has no config.json") from None
    except (OSError, ValueError) as e:
        error = ModelConfigUnreachable if _transient(e) else ModelConfigSourceError
        raise error(f"cannot fetch config.json of {model_id}: {_one_line(e)}") from None
    return load_local(path)


def _status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _answer_without_hub_headers(cause: BaseException | None) -> str | None:
    """What the hub answered, when huggingface_hub reports it as "not cached": an
    HTTP status that is the hub's answer (a 404 without X-Error-Code, a 403) or a
    success without the hub's metadata headers (a server that is no hub). None for no
    answer at all or a transient one (5xx, 429), which are worth asking again."""
    if cause is None:
        return None
    code = _status_code(cause)
    if code is not None and not _transient(cause):
        said = _one_line(cause).split(" For more information", 1)[0]
        return f"the hub answered HTTP {code}" + (" (not found)" if code == 404 else "") + (
            f", which it gives again: {said}")
    from huggingface_hub import errors

    if isinstance(cause, getattr(errors, "FileMetadataError", ())):  # lacking hub headers
        return _one_line(cause)
    return None


def _transient(exc: BaseException) -> bool:
    """Whether a failed download is the transport's (worth asking again): no answer
    at all (connection refused or reset, timeout: an OSError without an HTTP status),
    or the hub's 5xx and 429. Any other HTTP status is the hub's answer."""
    code = _status_code(exc)
    if code is not None:
        return code >= 500 or code in (408, 429)
    return isinstance(exc, OSError)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
