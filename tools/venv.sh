#!/usr/bin/env bash
# Create or refresh the project's virtual environment and print its python.
# The venv lives under $HOME (cached across runs); it is reinstalled only when
# pyproject.toml or the pins change. EXTRAS picks the optional dependency groups
# (comma-separated; default test,engine).
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
key="$(cat "$root/pyproject.toml" "$pins" | sha256sum | cut -c1-16)"
# The stamp is "KEY EXTRAS ROOT". A venv stamped with the same key and root and a
# superset of the extras asked for is up to date (`make demo` asks for test only,
# `make test` for test,engine: either order installs each package once); otherwise the
# extras already there are installed again with the new ones, so none is lost.
norm() { tr ',' '\n' | grep . | sort -u | paste -sd, -; }
had_key='' had_extras='' had_root=''
if [ -f "$stamp" ]; then read -r had_key had_extras had_root < "$stamp" || true; fi
had=$(echo "$had_extras" | norm || true)
if [ "$had_key" = "$key" ] && [ "$had_root" = "$root" ]; then
  all=$(echo "$had,$extras" | norm || true)
else
  all=$(echo "$extras" | norm || true) had=''
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[venv] creating $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip >&2
  had=''
fi
if [ "$had" != "$all" ]; then
  case ",$all," in
    *,engine,*) echo "[venv] installing spillway[$all] (first time: minutes, vLLM and torch are large)" >&2 ;;
    *) echo "[venv] installing spillway[$all]" >&2 ;;
  esac
  log="$venv/pip-install.log"
  if ! "$venv/bin/pip" install --constraint "$pins" -e "${root}[$all]" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "error: pip install failed; full log: $log" >&2
    exit 1
  fi
  echo "$key $all $root" > "$stamp"
fi
echo "$venv/bin/python"
