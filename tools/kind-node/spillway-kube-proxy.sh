#!/bin/bash
# kube-proxy on the kind node (spillway-kube-proxy.service), in place of kubeadm's
# kube-proxy DaemonSet (whose image would need iptables of its own): the same binary
# and release, with the node's iptables, under the node's credentials (kind's default
# CNI manifest binds the group system:nodes to system:node-proxier). Waits for the
# node to have joined.
until [ -s /etc/kubernetes/kubelet.conf ]; do sleep 1; done
exec /usr/local/bin/kube-proxy --config=/kind/kube-proxy.yaml --hostname-override="$(hostname)"
