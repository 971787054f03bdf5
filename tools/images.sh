#!/usr/bin/env bash
# Build (or reuse) Spillway's images from its own Dockerfile on this machine, with no
# image registry: a Debian base made with debootstrap, then the Dockerfile's `operator`
# and `engine-cpu` targets on top of it. Everything is cached under $HOME:
#   ~/.cache/spillway/docker/          the docker daemon's data root (image layers, build cache)
#   ~/.cache/spillway/images/          the base's root filesystem tarball, logs
# A docker daemon of its own is started when none answers on its socket, and left
# running for the callers (tests/images): `tools/images.sh --stop-daemon` stops it.
#
# Prints on stdout, one "NAME=VALUE" per line:
#   DOCKER_HOST=unix:///run/spillway/docker.sock   the daemon the refs live in
#   docker=/usr/bin/docker                         its own (20.10) command line
#   base=spillway-base:bookworm
#   operator=spillway-operator:local
#   engine=spillway-engine:local-cpu
#   source=<hash>                                  the tree the images were built from
#
#   tools/images.sh --refs           the same lines, building and starting nothing
#   tools/images.sh --stop-daemon    stop the daemon (and its containerd) started here
#   tools/images.sh --constraints    rewrite tools/images/constraints.txt from the venv
# Every failure is one line naming the step. SPILLWAY_DOCKERFILE builds another
# Dockerfile (tests/images uses a broken one).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${SPILLWAY_CACHE:-$HOME/.cache/spillway}
images=$cache/images
run=${SPILLWAY_RUN_DIR:-/run/spillway}  # sockets, pid files, the daemon's exec root
sock=$run/docker.sock
docker_host=unix://$sock
docker_cli=/usr/bin/docker  # Debian's 20.10, the daemon's own; no buildx needed
dockerfile=${SPILLWAY_DOCKERFILE:-$root/Dockerfile}
venv=${SPILLWAY_VENV:-$cache/venv}
constraints=$here/images/constraints.txt

base_ref=spillway-base:bookworm
operator_ref=spillway-operator:local
engine_ref=spillway-engine:local-cpu
# Bump to rebuild the base; the key also covers the packages and the host's extra CAs.
BASE_REV=1
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
mirror=${SPILLWAY_DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "[tools/images] $*" >&2; }
die() { echo "[tools/images] FAILED: $*" >&2; exit 1; }
docker() { DOCKER_HOST=$docker_host DOCKER_BUILDKIT=1 "$docker_cli" "$@"; }

source_hash() { python3 "$here/images/source_hash.py" "$root"; }

refs() {
  echo "DOCKER_HOST=$docker_host"
  echo "docker=$docker_cli"
  echo "base=$base_ref"
  echo "operator=$operator_ref"
  echo "engine=$engine_ref"
  echo "source=$(source_hash)"
}

# ------------------------------------------------------------------ daemon
daemon_up() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

# the pid in FILE when that process is alive and is COMMAND, else nothing
live_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then echo "$pid"; fi
}

stop_daemon() {
  local name pid
  for name in dockerd containerd; do
    pid=$(live_pid "$run/$name.pid" "$name")
    [ -n "$pid" ] || continue
    log "stopping $name (pid $pid)"
    kill "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then die "stop $name: pid $pid still running after 30 s"; fi
  done
}

wait_for() {  # wait_for SECONDS STEP CMD...: CMD until it succeeds, else die naming STEP
  local deadline=$((SECONDS + $1)) step=$2; shift 2
  until "$@"; do
    [ $SECONDS -lt $deadline ] || die "$step"
    sleep 0.5
  done
}

ensure_daemon() {
  if daemon_up; then log "docker daemon answers on $sock"; return; fi
  for b in /usr/sbin/dockerd /usr/bin/containerd "$docker_cli" /usr/sbin/runc; do
    [ -x "$b" ] || die "ensure docker daemon: $b missing (run tools/host.sh)"
  done
  local logs=$images/logs data=$cache/docker
  mkdir -p "$run" "$logs" "$data"
  # A containerd of its own (dockerd would otherwise use a system containerd's socket
  # whenever one exists, such as the real nodes'), without Kubernetes' CRI plug-in.
  if [ -z "$(live_pid "$run/containerd.pid" containerd)" ]; then
    rm -f "$run/containerd/containerd.sock"
    mkdir -p "$run/containerd"
    cat > "$run/containerd.toml" <<EOF
version = 2
root = "$data/containerd"
state = "$run/containerd"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$run/containerd/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$data/containerd/opt"
EOF
    setsid /usr/bin/containerd --config "$run/containerd.toml" \
      >"$logs/containerd.log" 2>&1 < /dev/null 9>&- &
    echo $! > "$run/containerd.pid"
    wait_for 30 "start containerd (log: $logs/containerd.log)" \
      test -S "$run/containerd/containerd.sock"
  fi
  # Build cache beyond 20 GB (an old vLLM layer after a pin change) is collected.
  cat > "$run/daemon.json" <<EOF
{"builder": {"gc": {"enabled": true, "defaultKeepStorage": "20GB"}}}
EOF
  if [ -n "$(live_pid "$run/dockerd.pid" dockerd)" ]; then  # started, not answering yet
    wait_for 60 "docker daemon (pid $(cat "$run/dockerd.pid")) does not answer on $sock (log: $logs/dockerd.log)" daemon_up
    return
  fi
  rm -f "$sock" "$run/dockerd.pid"
  log "starting dockerd (data root $data, socket $sock)"
  # No bridge, no iptables rules, no ip_forward change: the host's firewall belongs to
  # the real nodes (kube-proxy, CNI). Builds and test containers use the host's network
  # or none.
  setsid /usr/sbin/dockerd --data-root "$data" --exec-root "$run/docker" \
    --pidfile "$run/dockerd.pid" -H "$docker_host" --containerd "$run/containerd/containerd.sock" \
    --config-file "$run/daemon.json" --iptables=false --ip-forward=false --ip-masq=false \
    --bridge=none --userland-proxy=false \
    >"$logs/dockerd.log" 2>&1 < /dev/null 9>&- &
  wait_for 60 "start dockerd (log: $logs/dockerd.log)" daemon_up
  log "dockerd $(docker version --format '{{.Server.Version}}') up, storage driver $(docker info --format '{{.Driver}}')"
}

# ------------------------------------------------------------------ base
base_key() {
  { echo "$BASE_REV $BASE_SUITE $BASE_PACKAGES $mirror"
    cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
  } | sha256sum | cut -c1-16
}

ensure_base() {
  local key tarball tmp start=$SECONDS
  key=$(base_key)
  tarball=$images/base-$BASE_SUITE-$key.tar.gz
  if [ "$(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$base_ref" 2>/dev/null \
          | grep '^SPILLWAY_BASE=')" = "SPILLWAY_BASE=$key" ]; then
    log "base $base_ref ($key) present"; return
  fi
  if [ ! -s "$tarball" ]; then
    [ -x /usr/sbin/debootstrap ] || die "debootstrap: /usr/sbin/debootstrap missing (run tools/host.sh)"
    tmp=$images/tmp.base.$$
    rm -rf "$tmp"; mkdir -p "$tmp/rootfs"
    log "debootstrap $BASE_SUITE ($BASE_PACKAGES) from $mirror (cold: minutes) ..."
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$BASE_SUITE" "$tmp/rootfs" "$mirror" \
      >"$images/logs/debootstrap.log" 2>&1 \
      || { rm -rf "$tmp"; die "debootstrap $BASE_SUITE (log: $images/logs/debootstrap.log)"; }
    # The host's extra CAs (an intercepting egress proxy's), so pip inside a build
    # trusts what the host trusts; then a venv at /opt/venv, as `python` on PATH
    # (Debian's own python refuses pip installs, PEP 668).
    cp /usr/local/share/ca-certificates/*.crt "$tmp/rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$tmp/rootfs" /bin/sh -euc '
      update-ca-certificates >/dev/null
      python3 -m venv /opt/venv
      command -v groupadd >/dev/null && command -v useradd >/dev/null
      apt-get clean
      rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/* /usr/share/doc/* \
             /usr/share/man/* /usr/share/info/* /tmp/* /root/.cache
    ' >"$images/logs/base-chroot.log" 2>&1 \
      || { rm -rf "$tmp"; die "base chroot setup: CAs, /opt/venv, groupadd/useradd (log: $images/logs/base-chroot.log)"; }
    tar -C "$tmp/rootfs" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' \
      --exclude='./sys/*' -czf "$tmp/base.tar.gz" . \
      || { rm -rf "$tmp"; die "tar the base root filesystem"; }
    mv "$tmp/base.tar.gz" "$tarball"
    rm -rf "$tmp"
    find "$images" -maxdepth 1 -name "base-*.tar.gz" ! -name "$(basename "$tarball")" -delete
    log "base root filesystem built in $((SECONDS - start)) s: $tarball"
  fi
  local certs=/etc/ssl/certs/ca-certificates.crt
  docker import \
    --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV VIRTUAL_ENV=/opt/venv" --change "ENV LANG=C.UTF-8" \
    --change "ENV SSL_CERT_FILE=$certs" --change "ENV REQUESTS_CA_BUNDLE=$certs" \
    --change "ENV PIP_CERT=$certs" --change "ENV SPILLWAY_BASE=$key" \
    --change 'CMD ["python3"]' \
    "$tarball" "$base_ref" >/dev/null 2>"$images/logs/import.log" \
    || die "docker import $base_ref (log: $images/logs/import.log)"
  log "base $base_ref ($key) imported in $((SECONDS - start)) s"
}

# ------------------------------------------------------------------ targets
check_constraints() {
  [ -s "$constraints" ] || die "constraints: $constraints missing (tools/images.sh --constraints)"
  # the engine extra's pins (vLLM, torch) must be the constraints': the venv the tests ran
  python3 "$here/images/requirements.py" "$root/pyproject.toml" --check-pins engine "$constraints" \
    2>"$images/logs/constraints.log" \
    || die "constraints: $(cat "$images/logs/constraints.log") (tools/images.sh --constraints)"
}

deps_rebuilt() {  # deps_rebuilt LOG: a dependency layer of that build ran, not cached
  local n
  while read -r n; do
    grep -qx "#$n CACHED" "$1" || return 0
  done < <(sed -nE 's/^#([0-9]+) \[[^]]*\] RUN .*--constraint.*/\1/p' "$1" | sort -u)
  return 1
}

build() {  # build TARGET REF
  local target=$1 ref=$2 start=$SECONDS logf=$images/logs/build-$1.log
  log "docker build --target $target -> $ref (log: $logf) ..."
  docker build --network host --progress plain --target "$target" \
    --build-arg PYTHON_IMAGE="$base_ref" --label "dev.spillway.source=$source" \
    -f "$dockerfile" -t "$ref" "$root" >"$logf" 2>&1 \
    || die "docker build --target $target (log: $logf)"
  log "$ref built in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$ref" | numfmt --to=si --format=%.1f))"
}

write_constraints() {
  [ -x "$venv/bin/pip" ] || die "constraints: no venv at $venv (EXTRAS=test,engine tools/venv.sh)"
  { echo "# Generated by tools/images.sh --constraints from the project's tested venv"
    echo "# (${venv/#$HOME/\~}, EXTRAS=test,engine): the images install exactly these versions."
    "$venv/bin/pip" freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' \
      | grep -viE '^spillway=='
  } > "$constraints.tmp"
  mv "$constraints.tmp" "$constraints"
  log "wrote $constraints ($(grep -vc '^#' "$constraints") pins)"
}

case "${1:-}" in
  --refs) refs; exit 0 ;;
  --stop-daemon) stop_daemon; exit 0 ;;
  --constraints) write_constraints; exit 0 ;;
  "") ;;
  *) die "usage: tools/images.sh [--refs | --stop-daemon | --constraints]" ;;
esac

[ "$(id -u)" = 0 ] || die "ensure docker daemon: needs root (run as root)"
mkdir -p "$images/logs"
exec 9>"$images/.lock"
if ! flock -n 9; then
  log "waiting for another tools/images.sh to finish (lock $images/.lock) ..."
  flock -w 7200 9 || die "lock $images/.lock: another tools/images.sh held it for 2 hours"
fi
[ -f "$dockerfile" ] || die "Dockerfile: $dockerfile missing"
source=$(source_hash) || die "source hash (tools/images/source_hash.py)"
ensure_daemon
ensure_base
check_constraints
# Both targets at once (they share the wheel stage; the engine's pip install is network-
# and disk-bound, so the operator's comes almost free beside it). Each build's lines are
# printed when both are done, the operator's first, and a failure's one line last.
both=$images/logs/.both.$$
mkdir -p "$both"
build operator "$operator_ref" 2>"$both/operator" & op_pid=$!
build engine-cpu "$engine_ref" 2>"$both/engine" & engine_pid=$!
op_rc=0 engine_rc=0
wait "$op_pid" || op_rc=$?
wait "$engine_pid" || engine_rc=$?
grep -hv ' FAILED: ' "$both/operator" "$both/engine" >&2 || true
failed=$(grep -h ' FAILED: ' "$both/operator" "$both/engine" | head -n 1 || true)
rm -rf "$both"
if [ "$op_rc" != 0 ] || [ "$engine_rc" != 0 ]; then
  echo "${failed:-[tools/images] FAILED: docker build (operator exit $op_rc, engine-cpu exit $engine_rc)}" >&2
  exit 1
fi
# Rebuilt tags leave their old images dangling; the build cache keeps the layers.
docker image prune -f >/dev/null 2>&1 || die "docker image prune (dangling images)"
# New dependency layers (a pin change): the build cache still holds the old ones (the
# vLLM layer is ~9 GB); drop every cache record this run did not use.
if deps_rebuilt "$images/logs/build-operator.log" || deps_rebuilt "$images/logs/build-engine-cpu.log"; then
  docker builder prune -f --filter "until=$((SECONDS + 60))s" >"$images/logs/prune.log" 2>&1 \
    || die "docker builder prune (stale dependency layers; log: $images/logs/prune.log)"
  log "build cache: $(tail -n 1 "$images/logs/prune.log")"
fi
refs
