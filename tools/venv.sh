#!/usr/bin/env bash
# Create or refresh the project's virtual environment and print its python.
# The venv lives under $HOME (cached across runs); it is reinstalled only when
# pyproject.toml or the pins change. EXTRAS picks the optional dependency groups.
# Every package is pinned by tools/images/constraints.txt, the same pins the images
# install, so the venv the tests run in and the images they test are one set of
# versions on every machine (not whatever PyPI had the day a cache was made).
# A dependency pyproject adds that the pins lack resolves freely; then refresh the
# pins with tools/images.sh --constraints.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SPILLWAY_VENV:-$HOME/.cache/spillway/venv}
extras=${EXTRAS:-test,engine}
py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "error: Python >= 3.11 is required (found: $("$py" --version 2>&1))" >&2; exit 1
fi
stamp="$venv/.spillway-stamp"
pins=$root/tools/images/constraints.txt
want="$(cat "$root/pyproject.toml" "$pins" | sha256sum | cut -c1-16) $extras $root"
if [ ! -x "$venv/bin/python" ]; then
  echo "[venv] creating $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip >&2
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[venv] installing spillway[$extras] (first time: several minutes, vLLM and torch are large)" >&2
  log="$venv/pip-install.log"
  if ! "$venv/bin/pip" install --constraint "$pins" -e "$root[$extras]" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "error: pip install failed; full log: $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
