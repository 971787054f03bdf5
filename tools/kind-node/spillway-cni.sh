#!/bin/bash
# The kind node's pod network, in place of kind's kindnetd (an image that cannot be
# pulled here): run by spillway-cni.service on every node. Once the node has a podCIDR
# (the controller manager allocates them), it writes a CNI config: ptp + host-local over
# that range (a veth and a /32 route per pod, as kindnetd does: no bridge, so Services
# need no br_netfilter), plus portmap; the kubelet turns the node Ready when it appears.
# Then every few seconds it routes every other node's podCIDR via that node's
# InternalIP (the nodes share the docker network), and masquerades traffic from this
# node's pods to anything outside the cluster's pod range. Reads nodes with the node's
# own credentials (/etc/kubernetes/kubelet.conf).
set -u
kubeconfig=/etc/kubernetes/kubelet.conf
conf=/etc/cni/net.d/10-spillway.conflist
cluster_cidr=$(cat /kind/spillway-cluster-cidr 2>/dev/null || echo 10.244.0.0/16)
node=$(hostname)
log() { echo "spillway-cni: $*" >&2; }
kc() { kubectl --kubeconfig "$kubeconfig" --request-timeout=10s "$@"; }

write_conf() {  # write_conf PODCIDR
  local mtu
  mtu=$(cat /sys/class/net/eth0/mtu 2>/dev/null || echo 1500)
  mkdir -p "$(dirname "$conf")"
  cat > "$conf.tmp" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "spillway",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "mtu": $mtu,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{"dst": "0.0.0.0/0"}],
        "ranges": [[{"subnet": "$1"}]]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  mv "$conf.tmp" "$conf"
  log "wrote $conf for podCIDR $1"
}

own=""
while :; do
  if [ -s "$kubeconfig" ]; then
    nodes=$(kc get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.podCIDR}{" "}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' 2>/dev/null) || nodes=""
    while read -r name cidr ip; do
      if [ -z "$name" ] || [ -z "$cidr" ]; then continue; fi
      if [ "$name" = "$node" ]; then
        if [ "$cidr" != "$own" ] || [ ! -s "$conf" ]; then
          write_conf "$cidr"
          own=$cidr
        fi
        iptables -t nat -C POSTROUTING -s "$cidr" ! -d "$cluster_cidr" -m comment --comment spillway-cni -j MASQUERADE 2>/dev/null \
          || iptables -t nat -A POSTROUTING -s "$cidr" ! -d "$cluster_cidr" -m comment --comment spillway-cni -j MASQUERADE
      elif [ -n "$ip" ]; then
        ip route replace "$cidr" via "$ip" || log "ip route replace $cidr via $ip failed"
      fi
    done <<< "$nodes"
  fi
  if [ -n "$own" ]; then sleep 5; else sleep 1; fi
done
