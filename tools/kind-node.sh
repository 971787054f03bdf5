#!/usr/bin/env bash
# Build (or reuse) a kind node image on this machine, with no image registry: kind's
# own node image (kindest/node) cannot be pulled here. Made from
#   - a Debian root filesystem (debootstrap: systemd, Debian's containerd 1.6 and runc,
#     the CNI plugins, iptables, ...), cached as a tarball under ~/.cache/spillway/kind-node/;
#   - kind's own node files from the kind module (sigs.k8s.io/kind, tools/kind/go.mod):
#     its entrypoint, containerd config, systemd units (kubelet, 10-kubeadm.conf), copied
#     at build time, changed only where this machine needs it (below);
#   - the Kubernetes binaries tools/build.sh builds (kubelet, kubeadm, kubectl, kube-proxy,
#     crictl) and the control plane's images kubeadm asks for (kube-apiserver,
#     kube-controller-manager, kube-scheduler, etcd, CoreDNS, pause: one binary each on
#     busybox, tools/kind-node/images.py) preloaded into the node's containerd store, so
#     nothing is pulled;
#   - in place of kind's kindnetd and kubeadm's kube-proxy DaemonSet (images that cannot
#     be pulled): a pod network in the node (tools/kind-node/spillway-cni.sh: ptp +
#     host-local over the node's podCIDR, routes to the other nodes' pods) and kube-proxy
#     as a systemd service (clusters need `networking.kubeProxyMode: none`, which
#     e2e/kind/create-cluster.sh sets).
# This machine's changes: containerd's restrict_oom_score_adj = true and no negative
# OOMScoreAdjust in the units (this VM refuses negative oom_score_adj), and the nodes run
# under a runc wrapper (tools/kind-node/runc, registered with the docker daemon as the
# runtime "spillway-kind"): privileged containers ask for capabilities this VM withholds.
#
# The image lives in Spillway's docker daemon (tools/images.sh, unix:///run/spillway/docker.sock),
# tagged spillway.local/kind-node:v<K8S_VERSION>-<key> (the key covers every input) and
# spillway.local/kind-node:v<K8S_VERSION>. A warm run (the image is there) takes seconds.
# Prints on stdout, one "NAME=VALUE" per line:
#   node_image=spillway.local/kind-node:v1.35.4-<key>
#   kind=~/.cache/spillway/kind-node/bin/kind   kind, run against that daemon (DOCKER_HOST
#                                               unless set) with its nodes on the runc wrapper
#   kind_bin=<the kind binary itself>
#   DOCKER_HOST=unix:///run/spillway/docker.sock
#   kubectl=<kubectl of the same release>
#   tools/kind-node.sh --refs    the same lines (node_image: the stable tag), building and
#                                starting nothing
# Every failure is one line naming the step.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/versions.env"
cache=${SPILLWAY_CACHE:-$HOME/.cache/spillway}
work=$cache/kind-node
run=${SPILLWAY_RUN_DIR:-/run/spillway}
files=$here/kind-node
repo=spillway.local/kind-node
# Bump to rebuild the image; the key also covers the files, binaries and packages.
NODE_REV=1
SUITE=bookworm
# What kind's base image installs (images/base/Dockerfile), from Debian, plus Debian's
# containerd, runc and CNI plugins in place of kind's own builds of them.
PACKAGES=systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,e2fsprogs,bash,ca-certificates,jq,procps,socat,containerd,runc,containernetworking-plugins
mirror=${SPILLWAY_DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "[tools/kind-node] $*" >&2; }
die() { echo "[tools/kind-node] FAILED: $*" >&2; exit 1; }

bincache=${SPILLWAY_BIN_CACHE:-$cache/bin}
kind=$bincache/kind-v$KIND_VERSION/kind
stable=$repo:v$K8S_VERSION
docker_host=unix://$run/docker.sock
docker_cli=/usr/bin/docker

# The wrapper the callers run kind through: the daemon above, and `docker run` (kind
# runs nothing else with it) on the runtime spillway-kind.
write_kind_wrapper() {
  mkdir -p "$work/bin" "$work/shim"
  cat > "$work/shim/docker.tmp" <<EOF
#!/bin/sh
# Written by tools/kind-node.sh: kind's \`docker run\` of a node on the runc wrapper.
if [ "\${1:-}" = run ]; then shift; exec "$docker_cli" run --runtime=spillway-kind "\$@"; fi
exec "$docker_cli" "\$@"
EOF
  cat > "$work/bin/kind.tmp" <<EOF
#!/bin/sh
# Written by tools/kind-node.sh: kind against Spillway's docker daemon, its node
# containers on the runtime spillway-kind (tools/kind-node/runc).
export DOCKER_HOST="\${DOCKER_HOST:-$docker_host}"
export PATH="$work/shim:\$PATH"
exec "$kind" "\$@"
EOF
  chmod 0755 "$work/shim/docker.tmp" "$work/bin/kind.tmp"
  mv "$work/shim/docker.tmp" "$work/shim/docker"; mv "$work/bin/kind.tmp" "$work/bin/kind"
}

result() {
  echo "node_image=$1"
  echo "kind=$work/bin/kind"
  echo "kind_bin=$kind"
  echo "DOCKER_HOST=$docker_host"
  echo "kubectl=$bincache/k8s-v$K8S_VERSION/kubectl"
}

case "${1:-}" in
  --refs) write_kind_wrapper; result "$stable"; exit 0 ;;
  "") ;;
  *) die "usage: tools/kind-node.sh [--refs]" ;;
esac

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, the docker daemon's runtimes)"
mkdir -p "$work/logs" "$work/runtime"
exec 9>"$work/.lock"
flock -w 3600 9 || die "lock $work/.lock: another tools/kind-node.sh held it for an hour"

# ------------------------------------------------------------------ the daemon
refs=$("$here/images.sh" --refs 2>"$work/logs/refs.log") || die "tools/images.sh --refs (log: $work/logs/refs.log)"
if [ "$(sed -n 's/^DOCKER_HOST=//p' <<<"$refs")" != "$docker_host" ] ||
   [ "$(sed -n 's/^docker=//p' <<<"$refs")" != "$docker_cli" ]; then
  die "tools/images.sh --refs names another daemon than $docker_host ($docker_cli): revise tools/kind-node.sh"
fi
docker() { DOCKER_HOST=$docker_host "$docker_cli" "$@"; }
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "docker daemon: none answers on $docker_host (start it with tools/images.sh)"

# The runc wrapper, as the daemon's runtime "spillway-kind": added to the daemon's config
# file and reloaded with SIGHUP (the daemon keeps running; other runtimes are untouched).
ensure_runtime() {
  local wrapper=$work/runtime/spillway-runc conf=$run/daemon.json pid
  if ! cmp -s "$files/runc" "$wrapper"; then
    install -m 0755 "$files/runc" "$wrapper.tmp" && mv "$wrapper.tmp" "$wrapper"
  fi
  if docker info --format '{{json .Runtimes}}' 2>/dev/null | jq -e --arg p "$wrapper" \
       '.["spillway-kind"].path == $p' >/dev/null; then
    return
  fi
  [ -f "$conf" ] || die "register the runc wrapper: no $conf (the daemon was not started by tools/images.sh)"
  pid=$(cat "$run/dockerd.pid" 2>/dev/null) || die "register the runc wrapper: no $run/dockerd.pid"
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] || die "register the runc wrapper: pid $pid is not dockerd"
  jq --arg p "$wrapper" '.runtimes["spillway-kind"] = {path: $p}' "$conf" > "$conf.tmp" \
    || die "register the runc wrapper: rewrite $conf"
  mv "$conf.tmp" "$conf"
  kill -HUP "$pid"
  for _ in $(seq 1 40); do
    if docker info --format '{{json .Runtimes}}' | jq -e '.["spillway-kind"]' >/dev/null; then
      log "runtime spillway-kind ($wrapper) registered with dockerd (pid $pid)"
      return
    fi
    sleep 0.25
  done
  die "register the runc wrapper: dockerd (pid $pid) did not load runtime spillway-kind from $conf after SIGHUP"
}
ensure_runtime

# ------------------------------------------------------------------ the root filesystem
rootfs_key=$(echo "$NODE_REV $SUITE $PACKAGES $mirror" | sha256sum | cut -c1-16)
rootfs=$work/rootfs-$SUITE-$rootfs_key.tar.gz
if [ ! -s "$rootfs" ]; then
  [ -x /usr/sbin/debootstrap ] || die "debootstrap: /usr/sbin/debootstrap missing (run tools/host.sh)"
  tmp=$work/tmp.rootfs.$$
  rm -rf "$tmp"; mkdir -p "$tmp/rootfs"
  start=$SECONDS
  log "debootstrap $SUITE for the node image from $mirror (cold: minutes) ..."
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp/rootfs" "$mirror" \
    >"$work/logs/debootstrap.log" 2>&1 \
    || { rm -rf "$tmp"; die "debootstrap $SUITE (log: $work/logs/debootstrap.log)"; }
  chroot "$tmp/rootfs" /bin/sh -euc '
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/* /usr/share/doc/* \
           /usr/share/man/* /usr/share/info/* /tmp/* /root/.cache
  ' >"$work/logs/rootfs-clean.log" 2>&1 \
    || { rm -rf "$tmp"; die "clean the root filesystem (log: $work/logs/rootfs-clean.log)"; }
  tar -C "$tmp/rootfs" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' \
    --exclude='./sys/*' -czf "$tmp/rootfs.tar.gz" . || { rm -rf "$tmp"; die "tar the root filesystem"; }
  mv "$tmp/rootfs.tar.gz" "$rootfs"
  rm -rf "$tmp"
  find "$work" -maxdepth 1 -name "rootfs-*.tar.gz" ! -name "$(basename "$rootfs")" -delete
  log "root filesystem built in $((SECONDS - start)) s: $rootfs"
fi

# ------------------------------------------------------------------ binaries, kind's files
bins=$("$here/build.sh" k8s node etcd kubeadm crictl kind kindcoredns 2>"$work/logs/build.log") \
  || die "build the binaries: tools/build.sh k8s node etcd kubeadm crictl kind kindcoredns (log: $work/logs/build.log)"
dir_of() { sed -n "s/^$1=//p" <<<"$bins"; }
k8s=$(dir_of k8s) node=$(dir_of node) etcd=$(dir_of etcd) kubeadm=$(dir_of kubeadm)/kubeadm
crictl=$(dir_of crictl)/crictl coredns=$(dir_of kindcoredns)/coredns
kindsrc=$(cd "$here/kind" && go mod download -json sigs.k8s.io/kind 2>"$work/logs/kind-module.log" \
  | jq -r .Dir) || die "kind's node files: go mod download sigs.k8s.io/kind (log: $work/logs/kind-module.log)"
base=$kindsrc/images/base/files
[ -x "$base/usr/local/bin/entrypoint" ] || [ -f "$base/usr/local/bin/entrypoint" ] \
  || die "kind's node files: no images/base/files/usr/local/bin/entrypoint in $kindsrc"

[ -x "$kind" ] || die "build the binaries: tools/build.sh printed kind=$(dir_of kind), not $(dirname "$kind")"
write_kind_wrapper

# ------------------------------------------------------------------ the key
images=$("$kubeadm" config images list --kubernetes-version "v$K8S_VERSION" 2>"$work/logs/kubeadm-images.log") \
  || die "kubeadm config images list (log: $work/logs/kubeadm-images.log)"
key=$( {
  echo "$NODE_REV $rootfs_key $K8S_VERSION $KIND_VERSION"
  echo "$images"
  sha256sum "$0" "$files"/* "$here/../e2e/nodes/ociimage.py" \
    "$kindsrc/images/base/files/usr/local/bin/entrypoint" \
    "$k8s"/kube-{apiserver,controller-manager,scheduler} "$k8s/kubectl" "$node"/kube{let,-proxy} \
    "$etcd/etcd" "$kubeadm" "$crictl" "$coredns" /usr/bin/busybox | cut -d' ' -f1
  find "$base" -type f | sort | xargs sha256sum | cut -d' ' -f1
} | sha256sum | cut -c1-12)
ref=$repo:v$K8S_VERSION-$key
if docker image inspect "$ref" >/dev/null 2>&1; then
  log "node image $ref present"
  docker tag "$ref" "$stable" || die "docker tag $stable"
  result "$ref"
  exit 0
fi

# ------------------------------------------------------------------ the image
start=$SECONDS
tmp=$work/tmp.node.$$
ctd_pid=""
cleanup() {
  if [ -n "$ctd_pid" ]; then kill "$ctd_pid" 2>/dev/null || true; wait "$ctd_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
rm -rf "$tmp"; mkdir -p "$tmp/rootfs" "$tmp/images"
stage=$tmp/rootfs
log "building $ref (cold: a minute or two) ..."
tar -C "$stage" --numeric-owner -xzf "$rootfs" || die "unpack $rootfs"

# kind's files, as its Dockerfile copies them
install -d -m 0755 "$stage/kind" "$stage/kind/bin" "$stage/kind/manifests" "$stage/etc/containerd" \
  "$stage/etc/systemd/system/kubelet.service.d" "$stage/etc/default" "$stage/etc/sysctl.d" \
  "$stage/etc/kubernetes/manifests" "$stage/opt/cni" "$stage/usr/local/bin" "$stage/LICENSES" \
  || die "node files: directories"
{
  install -m 0755 "$base"/usr/local/bin/* "$stage/usr/local/bin/"
  cp -R "$base/kind/." "$stage/kind/" && chmod -R u+w,go-w "$stage/kind" && chmod 0644 "$stage/kind/README.txt"
  chmod 0755 "$stage"/kind/bin/*
  install -m 0644 "$base"/etc/crictl.yaml "$stage/etc/"
  install -m 0644 "$base"/etc/containerd/* "$stage/etc/containerd/"
  install -m 0644 "$base"/etc/default/* "$stage/etc/default/"
  install -m 0644 "$base"/etc/sysctl.d/* "$stage/etc/sysctl.d/"
  install -m 0644 "$base"/etc/systemd/system/*.service "$base"/etc/systemd/system/*.slice "$stage/etc/systemd/system/"
  install -m 0644 "$base"/etc/systemd/system/kubelet.service.d/* "$stage/etc/systemd/system/kubelet.service.d/"
  install -m 0644 "$base"/LICENSES/* "$stage/LICENSES/"
} 2>"$work/logs/node-files.log" || die "node files: copy kind's images/base/files (log: $work/logs/node-files.log)"

# Debian's containerd, ctr and shim live in /usr/bin; kind's unit runs /usr/local/bin/containerd.
ln -sf /usr/bin/containerd "$stage/usr/local/bin/containerd"
# Debian's CNI plugins (ptp, host-local, portmap, loopback) where containerd looks for them
rm -rf "$stage/opt/cni/bin"; ln -s /usr/lib/cni "$stage/opt/cni/bin"
# The binaries
{
  install -m 0755 "$node/kubelet" "$kubeadm" "$k8s/kubectl" "$stage/usr/bin/"
  install -m 0755 "$node/kube-proxy" "$crictl" "$stage/usr/local/bin/"
} 2>"$work/logs/node-binaries.log" || die "node files: install the binaries (log: $work/logs/node-binaries.log)"
# Spillway's own: the pod network, kube-proxy, kind's default CNI and storage manifests
{
  install -m 0755 "$files/spillway-cni.sh" "$files/spillway-kube-proxy.sh" "$stage/kind/bin/"
  install -m 0644 "$files/spillway-cni.service" "$files/spillway-kube-proxy.service" "$stage/etc/systemd/system/"
  install -m 0644 "$files/kube-proxy.yaml" "$stage/kind/"
  install -m 0644 "$files/default-cni.yaml" "$files/default-storage.yaml" "$stage/kind/manifests/"
  echo "v$K8S_VERSION" > "$stage/kind/version"
} 2>"$work/logs/node-spillway.log" || die "node files: Spillway's (log: $work/logs/node-spillway.log)"

# containerd: the sandbox image kubeadm names; restrict_oom_score_adj (negative
# oom_score_adj is refused here); the base runtime spec as kind's Dockerfile makes it.
pause=$(grep '/pause:' <<<"$images") || die "kubeadm's image list names no pause image"
conf=$stage/etc/containerd/config.toml
sed -i -e "s#sandbox_image = .*#sandbox_image = \"$pause\"#" \
  -e 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' "$conf"
{ grep -q "sandbox_image = \"$pause\"" "$conf" && grep -q 'restrict_oom_score_adj = true' "$conf"; } \
  || die "containerd config: kind's config.toml no longer has sandbox_image / restrict_oom_score_adj as expected"
if ! ctr oci spec 2>"$work/logs/oci-spec.log" \
  | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
  | jq 'del(.process.rlimits)' > "$stage/etc/containerd/cri-base.json" ||
   [ ! -s "$stage/etc/containerd/cri-base.json" ]; then
  die "containerd base runtime spec: ctr oci spec (log: $work/logs/oci-spec.log)"
fi

# systemd: what kind's Dockerfile does, and no negative OOMScoreAdjust (EACCES here)
# shellcheck disable=SC2016  # expanded by the chroot's shell
chroot "$stage" /bin/sh -euc '
  find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete
  rm -f /lib/systemd/system/multi-user.target.wants/*
  rm -f /etc/systemd/system/*.wants/*
  rm -f /lib/systemd/system/local-fs.target.wants/*
  rm -f /lib/systemd/system/sockets.target.wants/*udev*
  rm -f /lib/systemd/system/sockets.target.wants/*initctl*
  rm -f /lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >> /etc/systemd/journald.conf
  ln -sf /usr/lib/systemd/systemd /sbin/init
  systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
    spillway-cni.service spillway-kube-proxy.service
  systemctl mask systemd-binfmt.service
  grep -rl "^OOMScoreAdjust=-" /etc/systemd /lib/systemd 2>/dev/null | while read -r f; do
    sed -i "s/^OOMScoreAdjust=-.*/OOMScoreAdjust=0/" "$f"
  done
  ! grep -rq "^OOMScoreAdjust=-" /etc/systemd /lib/systemd
' >"$work/logs/node-systemd.log" 2>&1 || die "node systemd units: enable, mask, OOMScoreAdjust (log: $work/logs/node-systemd.log)"

# The control plane's images, preloaded into the node's containerd store (namespace
# k8s.io, not unpacked, pinned), by a containerd of our own on the staged /var/lib/containerd.
specs=()
while read -r img; do
  [ -n "$img" ] || continue
  case "$img" in
    */kube-apiserver:*) specs+=("$img=$k8s/kube-apiserver") ;;
    */kube-controller-manager:*) specs+=("$img=$k8s/kube-controller-manager") ;;
    */kube-scheduler:*) specs+=("$img=$k8s/kube-scheduler") ;;
    */kube-proxy:*) ;;  # kube-proxy runs as a systemd service in the node
    */etcd:*) specs+=("$img=$etcd/etcd") ;;
    */coredns:*) specs+=("$img=$coredns@/coredns!/coredns") ;;
    */pause:*) specs+=("$img=pause") ;;
    *) die "kubeadm's image list names $img, which tools/kind-node.sh does not make" ;;
  esac
done <<<"$images"
python3 "$files/images.py" "$tmp/images" "${specs[@]}" >"$work/logs/images.log" 2>&1 \
  || die "control-plane images: tools/kind-node/images.py (log: $work/logs/images.log)"
sock=$tmp/ctd/c.sock
mkdir -p "$tmp/ctd"
cat > "$tmp/ctd/config.toml" <<EOF
version = 2
root = "$stage/var/lib/containerd"
state = "$tmp/ctd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$sock"
EOF
/usr/bin/containerd --config "$tmp/ctd/config.toml" >"$work/logs/containerd.log" 2>&1 &
ctd_pid=$!
for _ in $(seq 1 60); do [ -S "$sock" ] && break; sleep 0.25; done
[ -S "$sock" ] || die "control-plane images: start containerd for the node's store (log: $work/logs/containerd.log)"
for archive in "$tmp"/images/*.tar; do
  ctr -a "$sock" -n k8s.io images import --all-platforms --no-unpack --digests "$archive" \
    >>"$work/logs/import.log" 2>&1 || die "control-plane images: ctr import $archive (log: $work/logs/import.log)"
done
while read -r img; do
  [ -n "$img" ] || continue
  case "$img" in */kube-proxy:*) continue ;; esac
  ctr -a "$sock" -n k8s.io images label "$img" io.cri-containerd.pinned=pinned >>"$work/logs/import.log" 2>&1 \
    || die "control-plane images: $img not in the node's store after import (log: $work/logs/import.log)"
done <<<"$images"
kill "$ctd_pid"; wait "$ctd_pid" 2>/dev/null || true; ctd_pid=""
rm -rf "$stage/var/lib/containerd/tmpmounts"

tar -C "$stage" --numeric-owner -c . 2>"$work/logs/node-tar.log" \
  | docker import - "$ref-rootfs" >/dev/null 2>"$work/logs/node-import.log" \
  || die "docker import $ref-rootfs (log: $work/logs/node-import.log)"
rm -rf "$stage"
# what kind's Dockerfile sets (docker import takes no STOPSIGNAL)
docker build -t "$ref" --label "dev.spillway.kind-node=$key" - >"$work/logs/node-build.log" 2>&1 <<EOF \
  || die "docker build $ref from $ref-rootfs (log: $work/logs/node-build.log)"
FROM $ref-rootfs
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
EOF
docker rmi "$ref-rootfs" >/dev/null || die "docker rmi $ref-rootfs"
docker tag "$ref" "$stable" || die "docker tag $stable"
# older node images of this repository: removed when no container uses them
docker image ls --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -vxF -e "$ref" -e "$stable" \
  | xargs -r -n1 "$docker_cli" -H "$docker_host" rmi >/dev/null 2>&1 || true
log "node image $ref built in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$ref" | numfmt --to=si --format=%.1f))"
result "$ref"
