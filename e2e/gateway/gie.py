"""The Gateway API Inference Extension's own endpoint picker (GIE v1.2.0, ``cmd/epp``),
run the way GIE runs it: against an ``InferencePool`` and its pods in a Kubernetes API.

``tools/build.sh`` builds the picker from the Go module proxy (pinned GIE_VERSION, CGO
off) into ``$SPILLWAY_BIN_CACHE/gie-v*/epp``, beside GIE's CRDs. The picker reads its
pool and the pool's pods through controller-runtime (no standalone or static-endpoint
mode in v1.2.0: even ``--endpoint-selector`` watches pods), so :class:`GiePicker` gives it
a Kubernetes API of its own: etcd and kube-apiserver alone
(``LocalCluster.start_api_only``), GIE's CRDs, one InferencePool, and one Ready pod per
engine address, whose ``podIP`` is the address an engine process listens on (127/8 is
all loopback). Nothing schedules or runs those pods; their status is written here.

What the picker needs from the engines, and what it is given:

* ``/metrics`` on each pod's target port, every 50 ms: ``vllm:num_requests_waiting``
  (queue scorer) and the KV-cache usage metric (kv-cache-utilization scorer). GIE
  v1.2.0's default name for the latter is ``vllm:gpu_cache_usage_perc``, which vLLM no
  longer exports; vLLM 0.33 (and the simulator) export ``vllm:kv_cache_usage_perc``,
  which ``--kv-cache-usage-percentage-metric`` names. ``vllm:lora_requests_info`` is
  absent without LoRA, which GIE takes as no adapters (a partial scrape is kept).
* GIE's chart profile (``config/charts/inferencepool``): queue-scorer 2,
  kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score picker. The prefix
  scorer hashes the prompt's *characters* in blocks, with no tokenizer and no KV events:
  what it believes cached is what it sent where, in a per-pod LRU. With ``autoTune`` it
  sizes that from ``vllm:cache_config_info`` (block_size x 4 characters per block,
  num_gpu_blocks entries), which the simulator does not export; the parameters here are
  the values autoTune would take from a vLLM that did (:func:`picker_config`), with the
  prompts' real characters per token where the caller knows it.
* Requests whose prompt is text: GIE v1.2.0 parses ``prompt`` as a string (or chat
  ``messages``); a completion with token ids is refused with 400.

Envoy talks to it in GIE's own processing mode: request and response bodies
``FULL_DUPLEX_STREAMED`` (the picker answers body chunks with streamed mutations, which a
buffered mode does not accept), trailers sent, failing closed (the InferencePool's
default) -- :func:`gateway_config`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from e2e import processes
from e2e.cluster import ClusterConfig, LocalCluster
from e2e.cluster.controlplane import (
    Ports,
    default_bin_cache,
    free_port,
    locate_gie_crds,
    read_versions,
)
from e2e.gateway.envoy import FAIL_CLOSE, GatewayConfig

NAMESPACE, POOL, APP = "gie-bench", "engines", "gie-engine"
DUPLEX = "FULL_DUPLEX_STREAMED"
#: vLLM's name for the GPU KV-cache usage gauge since it renamed gpu_cache_usage_perc
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
#: GIE's estimate of characters per token (prefix plugin, averageCharactersPerToken)
CHARS_PER_TOKEN = 4


def picker_binary(cache: Path | None = None) -> Path:
    """GIE's endpoint picker as tools/build.sh builds it; missing is an error naming
    the fix (never a skip: CI builds it first)."""
    version = read_versions()["GIE_VERSION"]
    path = (cache or default_bin_cache()) / f"gie-v{version}" / "epp"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(
            f"missing {path} (GIE v{version}'s endpoint picker) -- build it with "
            "tools/build.sh (or point SPILLWAY_BIN_CACHE at a folder that holds it)")
    return path


def pod_addresses(n: int) -> list[str]:
    """``n`` engine addresses as a pool needs them: a pod IP each (127.N.0.i, all
    loopback, N random in 200..250) and one port, free on all of them."""
    net = f"127.{random.randint(200, 250)}.0"
    while True:
        port, taken = free_port(), False
        for i in range(n):
            with socket.socket() as s:
                try:
                    s.bind((f"{net}.{i + 1}", port))
                except OSError:
                    taken = True
        if not taken:
            return [f"{net}.{i + 1}:{port}" for i in range(n)]


def picker_config(block_tokens: int, gpu_blocks: int,
                  chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """GIE's chart profile; the prefix scorer sized as autoTune would size it from
    ``vllm:cache_config_info`` (block_size ``block_tokens``, num_gpu_blocks
    ``gpu_blocks``), at GIE's 4 characters per token, or at ``chars_per_token`` where
    the prompts' real figure is known (so that a block of characters is a KV block and
    the LRU holds what the GPU holds). JSON, which the picker's YAML loader reads."""
    return json.dumps({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {
                "autoTune": False, "blockSize": round(block_tokens * chars_per_token),
                "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": gpu_blocks}},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
        ]}],
    })


def gateway_config(picker: str, endpoints: list[str], **kw: Any) -> GatewayConfig:
    """Envoy in front of GIE's picker, in GIE's processing mode (failing closed)."""
    return GatewayConfig(picker=picker, endpoints=endpoints, port=free_port(),
                         admin_port=free_port(), failure_mode=FAIL_CLOSE, body_mode=DUPLEX,
                         response_body_mode=DUPLEX, response_trailer_mode="SEND",
                         picker_timeout_s=10.0, **kw)


def pool_manifest(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "targetPorts": [{"number": port}],
            # the picker runs as a process; the Service it names is never resolved here
            "endpointPickerRef": {"kind": "Service", "name": f"{POOL}-epp",
                                  "port": {"number": 9002}, "failureMode": FAIL_CLOSE},
        },
    }


def pod_manifest(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"engine-{i}", "namespace": NAMESPACE, "labels": {"app": APP}},
        # bound to a node that does not exist: nothing schedules or runs it
        "spec": {"nodeName": "engines", "containers": [{"name": "engine", "image": "sim"}]},
    }


def ready_status(ip: str) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
        "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                       for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
    }}


class GiePicker:
    """The API server, the pool and its pods, and GIE's picker; a context manager.

    ``endpoints``: the engines, ``ip:port`` with one port for all (a pool has one set of
    target ports) and a distinct 127/8 IP each. ``picker`` is its gRPC address."""

    def __init__(self, workdir: Path, endpoints: list[str], *, block_tokens: int = 16,
                 gpu_blocks: int = 512, chars_per_token: float = CHARS_PER_TOKEN) -> None:
        ports = {e.rsplit(":", 1)[1] for e in endpoints}
        if len(ports) != 1:
            raise ValueError(f"one target port for the whole pool, not {sorted(ports)}")
        self.workdir, self.endpoints = workdir, endpoints
        self.port = int(ports.pop())
        self.config = picker_config(block_tokens, gpu_blocks, chars_per_token)
        self.binary = picker_binary()
        self.cluster = LocalCluster(ClusterConfig(workdir=workdir / "api", ports=Ports.free(),
                                                  nodes=0, lws=False))
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "epp.log"

    @property
    def picker(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout: float = 90.0) -> GiePicker:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.cluster.start_api_only()
            self._objects(timeout)
            self._start_picker(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _objects(self, timeout: float) -> None:
        from kubernetes import client, config

        kc = self.cluster.kubectl
        kc("apply", "--server-side", "-f", str(locate_gie_crds()))
        self.cluster.wait_established(timeout=timeout)
        api = config.new_client_from_config(config_file=str(self.cluster.config.kubeconfig))
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        # the ServiceAccount admission wants one; no controller-manager makes it here
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}})
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            "inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools",
            pool_manifest(self.port))
        for i, endpoint in enumerate(self.endpoints):
            core.create_namespaced_pod(NAMESPACE, pod_manifest(i))
            core.patch_namespaced_pod_status(f"engine-{i}", NAMESPACE,
                                             ready_status(endpoint.rsplit(":", 1)[0]))
        api.close()

    def _start_picker(self, timeout: float) -> None:
        cmd = [
            str(self.binary), "--pool-name", POOL, "--pool-namespace", NAMESPACE,
            "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(free_port()),
            "--metrics-port", str(self.metrics_port), "--metrics-endpoint-auth=false",
            "--secure-serving=false", "--tracing=false", "--enable-pprof=false",
            "--kv-cache-usage-percentage-metric", KV_USAGE_METRIC,
            "--config-text", self.config, "--zap-encoder", "json",
        ]
        env = {**os.environ, "KUBECONFIG": str(self.cluster.config.kubeconfig)}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while len(self.pods()) < len(self.endpoints):
            if self.proc.poll() is not None:
                raise RuntimeError(f"GIE's picker exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"GIE's picker did not list the {len(self.endpoints)} "
                                   f"pods in {timeout:.0f} s: {self.log}")
            time.sleep(0.2)

    def pods(self) -> dict[str, float]:
        """The pods in the picker's datastore and the queue size it last scraped from
        each (its ``inference_pool_per_pod_queue_size``); empty while it starts."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("inference_pool_per_pod_queue_size{"):
                pod = line.split('model_server_pod="', 1)[1].split('"', 1)[0]
                out[pod] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        processes.stop(self.proc, 10)
        self.cluster.stop()

    def __enter__(self) -> GiePicker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
