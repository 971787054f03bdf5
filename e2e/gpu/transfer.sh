#!/usr/bin/env bash
# GPU check of Spillway's transfer path alone (torch + cuda-bindings, no vLLM): store
# and load GB/s of Gemma-3-27B, Qwen3-Next-80B and Llama-3.1-70B page layouts through
# the worker's CUDA lanes and cuMemcpyBatchAsync, with byte-exact round trips.
# See e2e/gpu/README.md ("Transfer check").
#
#   bash e2e/gpu/transfer.sh [--gib 4] [--models llama-3.1-70b] [--ids random]
#
# Python: $SPILLWAY_GPU_PYTHON, else python3. Report: $OUT/transfer-check.json (else
# ./transfer-check.json). Exit 0 pass, 1 a byte differed, 3 torch/CUDA/cuda-bindings
# missing (one line says which), 124 past $SPILLWAY_TRANSFER_TIMEOUT (280 s).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${SPILLWAY_GPU_PYTHON:-python3}"
export PYTHONPATH="$repo/engine${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=10 "${SPILLWAY_TRANSFER_TIMEOUT:-280}" \
  "$py" "$here/transfer_check.py" "$@"
