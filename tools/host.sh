#!/usr/bin/env bash
# Install the Debian packages that real containers and real nodes need on this host:
# a container runtime (containerd + runc, and docker.io to build images), CNI plugins,
# iptables/conntrack for kube-proxy, debootstrap for the base image, busybox-static
# for the small test and pause images. Idempotent: a host that has them installs nothing.
# Every failure is one line naming the step.
set -euo pipefail
log() { echo "[tools/host] $*" >&2; }
die() { echo "[tools/host] FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "real nodes need root (kubelet, containerd, iptables); run as root"

# command the package provides -> package
declare -A need=(
  [/usr/bin/containerd]=containerd [/usr/sbin/runc]=runc [/usr/bin/ctr]=containerd
  [/usr/sbin/dockerd]=docker.io [/usr/bin/docker]=docker.io
  [/usr/lib/cni/bridge]=containernetworking-plugins [/usr/lib/cni/host-local]=containernetworking-plugins
  [/usr/sbin/iptables]=iptables [/usr/sbin/conntrack]=conntrack
  [/usr/sbin/debootstrap]=debootstrap [/usr/bin/busybox]=busybox-static
  [/usr/sbin/ipset]=ipset [/usr/bin/socat]=socat
)
missing=()
for path in "${!need[@]}"; do [ -x "$path" ] || missing+=("${need[$path]}"); done
if [ ${#missing[@]} = 0 ]; then log "host packages present"; exit 0; fi
pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
log "installing Debian packages: $pkgs"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || die "apt-get update (are Debian's package mirrors reachable?)"
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $pkgs >/tmp/spillway-host-apt.log 2>&1 \
  || die "apt-get install $pkgs (log: /tmp/spillway-host-apt.log)"
for path in "${!need[@]}"; do [ -x "$path" ] || die "$path still missing after installing ${need[$path]}"; done
log "host packages installed"
