"""Faults on the real nodes: a node's kubelet or containerd killed and started again
from the same command line, a pod's network cut with iptables, a whole node lost.

Used by the fault bench (``python -m bench.node_faults``) and the real-nodes tier. The
processes are the ones ``RealNodes`` started (found from its record); restarted ones go
back into the record, so ``e2e/cluster/down`` still finds them. The iptables chain is
named ``SPILLWAY-FAULT``: ``down`` removes every ``SPILLWAY-*`` chain, even after a
crash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from e2e.nodes.realnodes import PATH, NodeError, NodeSpec, RealNodes, _alive, _kill_all

FAULT_CHAIN = "SPILLWAY-FAULT"
COMPONENTS = ("kubelet", "containerd", "gpuplugin")
#: A restarted kubelet still running this long after its start got past the CRI check.
KUBELET_STAYS_UP_S = 3.0


class NodeFaults:
    """Break and mend one real node's parts. ``nodes``: the cluster's RealNodes."""

    def __init__(self, nodes: RealNodes) -> None:
        self.nodes = nodes
        self._argv: dict[str, list[str]] = {}  # key -> the command line it ran with

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes.nodes if n.name == name)

    def pid(self, component: str, node: str) -> int:
        record = self.nodes.read_record() or {}
        return record["pids"][f"{component}/{node}"]["pid"]

    def stop(self, component: str, node: str, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop one part of a node (its command line is kept for ``start``). SIGKILL is
        sent at once with ``sig=SIGKILL``; else TERM, then KILL after 15 s."""
        key = f"{component}/{node}"
        pid = self.pid(component, node)
        if not _alive(pid):
            raise NodeError(f"{key} (pid {pid}) is not running")
        self._argv[key] = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") \
            .decode().split("\0")
        if sig == signal.SIGKILL:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            _kill_all([pid], 15)
        if _alive(pid):
            raise NodeError(f"{key} (pid {pid}) did not stop")

    def start(self, component: str, node: str, timeout: float = 60) -> None:
        """Start a stopped part again, in the node's mount namespace, as it ran before;
        containerd: wait until it answers."""
        key = f"{component}/{node}"
        spec = self.node(node)
        proc = self._spawn(key, component, node)
        if component == "kubelet":
            # A kubelet started while its containerd's CRI still initialises (containerd
            # answers `ctr version` before that) exits at once: "validate CRI v1 runtime
            # API ... server is not initialized yet". Start it again until it stays up.
            deadline = time.monotonic() + timeout
            time.sleep(KUBELET_STAYS_UP_S)
            while proc.poll() is not None:
                if time.monotonic() > deadline:
                    raise NodeError(f"{key} exited ({proc.returncode}) at every start for "
                                    f"{timeout:.0f}s; see {self.nodes.logs}/kubelet-{node}.log")
                proc = self._spawn(key, component, node)
                time.sleep(KUBELET_STAYS_UP_S)
        if component == "containerd":
            def answers() -> bool:
                return subprocess.run(["ctr", "--address", str(spec.socket), "version"],
                                      capture_output=True, timeout=10).returncode == 0
            self.nodes._wait(f"{node}'s containerd to answer", answers, proc,
                             f"containerd-{node}.log", timeout)

    def _spawn(self, key: str, component: str, node: str) -> subprocess.Popen:
        with self.nodes._locked():
            self.nodes.record = self.nodes.read_record() or {}
            return self.nodes._spawn(key, self._argv[key], f"{component}-{node}.log",
                                     self.node(node).ns_file)

    def restart(self, component: str, node: str,
                sig: signal.Signals = signal.SIGTERM) -> None:
        self.stop(component, node, sig)
        self.start(component, node)

    def kill_containers(self, node: str) -> int:
        """SIGKILL every process in the node's pod cgroups (what a node losing power
        does to its containers; their shims go too). Returns how many were killed."""
        pids: set[int] = set()
        root = Path("/sys/fs/cgroup/memory") / self.node(node).cgroup_root.lstrip("/")
        for procs in root.rglob("cgroup.procs"):
            pids.update(int(x) for x in procs.read_text().split())
        shims = subprocess.run(["pgrep", "-f", f"containerd-shim.*{self.node(node).socket}"],
                               capture_output=True, text=True, check=False).stdout.split()
        pids.update(int(p) for p in shims)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    # ----------------------------------------------------------------- network

    @staticmethod
    def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True,
                              check=check, env={**os.environ, "PATH": PATH})

    def cut(self, ip: str) -> None:
        """Drop every packet to and from ``ip`` (a pod's address) on the host, which is
        every node's network namespace: kubelet probes, the router, the other pods."""
        if self._iptables("-L", FAULT_CHAIN, "-n", check=False).returncode != 0:
            self._iptables("-N", FAULT_CHAIN)
        for chain in ("FORWARD", "INPUT", "OUTPUT"):
            if self._iptables("-C", chain, "-j", FAULT_CHAIN, check=False).returncode:
                self._iptables("-I", chain, "1", "-j", FAULT_CHAIN)
        if ip:
            self._iptables("-A", FAULT_CHAIN, "-d", ip, "-j", "DROP")
            self._iptables("-A", FAULT_CHAIN, "-s", ip, "-j", "DROP")

    def block_port(self, port: int) -> None:
        """Refuse every new TCP connection to ``port`` between pods (a NetworkPolicy
        that leaves the port out, as a CNI that enforces one would)."""
        self.cut("")  # the chain and its jumps, no address rule
        self._iptables("-A", FAULT_CHAIN, "-p", "tcp", "--dport", str(port), "-j", "REJECT",
                       "--reject-with", "tcp-reset")

    def heal(self) -> None:
        """Remove every cut (the chain and its jumps)."""
        for chain in ("FORWARD", "INPUT", "OUTPUT"):
            while not self._iptables("-D", chain, "-j", FAULT_CHAIN, check=False).returncode:
                pass
        self._iptables("-F", FAULT_CHAIN, check=False)
        self._iptables("-X", FAULT_CHAIN, check=False)
