#!/usr/bin/env bash
# GPU check of Spillway's host KV tier (vLLM 0.33.0 + SpillwayOffloadingConnector) on
# three tiny dummy-weight models. See e2e/gpu/README.md.
#
#   bash e2e/gpu/run.sh              # the check (needs one CUDA GPU and vllm==0.33.0)
#   bash e2e/gpu/run.sh --dry-run    # CPU only: write + validate the configs
#   bash e2e/gpu/run.sh --preflight  # only say what is missing
#
# Python: $SPILLWAY_GPU_PYTHON, else <repo>/.venv, else ~/.cache/spillway/venv, else
# python3. Results: $OUT/gpu-offload-check.json (+ .log) when $OUT is set, and
# $TMPDIR/spillway-gpu-check/. Exit: 0 pass, 1 a check failed, 3 vLLM/GPU/connector
# missing (one line says what), 124 the whole run hit $SPILLWAY_GPU_CHECK_TIMEOUT.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

py="${SPILLWAY_GPU_PYTHON:-}"
if [[ -z "$py" ]]; then
  for candidate in "$repo/.venv/bin/python" "$HOME/.cache/spillway/venv/bin/python"; do
    if [[ -x "$candidate" ]]; then
      py="$candidate"
      break
    fi
  done
fi
py="${py:-python3}"
if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu-offload-check: cannot run: no Python interpreter ($py)" >&2
  exit 3
fi

export PYTHONPATH="$repo/engine:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# The Python side keeps its own budget (--budget-s, default 420 s) and kills its runs;
# this outer limit only catches a hang of the parent itself.
exec timeout --signal=TERM --kill-after=20 "${SPILLWAY_GPU_CHECK_TIMEOUT:-470}" \
  "$py" "$here/offload_check.py" "$@"
