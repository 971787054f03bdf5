"""One vLLM instance across several pods (nodes): vLLM 0.33's multi-node form, no Ray.

The operator renders a replica that needs more GPUs than one node holds as a
LeaderWorkerSet group: every pod runs ``spillway-engine serve --plan ... --nnodes N``
with the same arguments, and LWS's pod webhook tells each pod who it is
(``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``; 0 is the leader).
:func:`node_from` turns that (or ``--node-rank`` / ``--master-addr`` for local tests)
into a :class:`Node`, and :func:`parallel_launch` -- pure -- into vLLM's own flags:

* tensor / pipeline parallelism across nodes (``data_parallel_size`` 1): ``--nnodes N
  --node-rank r --master-addr LEADER --master-port P`` on every node, ``--headless`` on
  ranks > 0. vLLM's leader (rank 0) runs the API server and the engine core, whose
  ``MultiprocExecutor`` starts its local workers and reaches the others through
  torch.distributed at ``LEADER:P`` and ZMQ message queues (``vllm/entrypoints/cli/
  serve.py`` ``run_headless``: ranks > 0 run a ``MultiprocExecutor`` of their own local
  workers only; ``vllm/v1/executor/multiproc_executor.py``).
* data parallelism across nodes (``data_parallel_size`` > 1): each node holds
  ``DP / N`` whole engines: ``--data-parallel-size-local DP/N
  --data-parallel-address LEADER --data-parallel-rpc-port P`` everywhere, and on ranks
  > 0 ``--headless --data-parallel-start-rank r * DP/N`` (the leader gives no start
  rank: vLLM would read one as hybrid load balancing and serve only its local ranks).

A headless rank first waits until the leader's address resolves and its port takes a
TCP connection (:func:`wait_for_leader`); one that cannot reach it stops with a line
naming the address, the port and what to check, which the operator shows.

GPUs per node are ``TP x PP x DP / N`` and must be a whole number. With a
``pipeline_layer_partition`` in the plan ``VLLM_PP_LAYER_PARTITION`` is exported (one
node or many), so every stage builds the layers the plan's stages hold.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spillway_engine.planner.plan import Plan
from spillway_engine.seam import DIST_PORT  # the operator's container port (the seam)

#: What LeaderWorkerSet's pod webhook injects into every pod of a group.
ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
ENV_WORKER_INDEX = "LWS_WORKER_INDEX"
#: vLLM's split of the decoder layers over the pipeline stages.
ENV_PP_LAYER_PARTITION = "VLLM_PP_LAYER_PARTITION"


class MultiNodeError(ValueError):
    """The rank information or the plan's parallelism cannot be split over the nodes."""


@dataclass(frozen=True)
class Node:
    """This pod's place in its replica."""

    nnodes: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int = DIST_PORT

    @property
    def headless(self) -> bool:
        """Ranks > 0 run no API server (vLLM's ``--headless``)."""
        return self.nnodes > 1 and self.rank > 0


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise MultiNodeError(f"{name}={text!r} is not a whole number") from None


def node_from(
    nnodes: int,
    env: Mapping[str, str],
    *,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int = DIST_PORT,
) -> Node:
    """This pod's :class:`Node`: the flags when given, else LWS's environment."""
    if nnodes < 1:
        raise MultiNodeError(f"--nnodes {nnodes} must be at least 1")
    if nnodes == 1:
        return Node()
    group = _int_env(env, ENV_GROUP_SIZE)
    if group is not None and group != nnodes:
        raise MultiNodeError(
            f"--nnodes {nnodes} but {ENV_GROUP_SIZE}={group}: the LeaderWorkerSet's group "
            "size and the engine's node count must agree"
        )
    rank = node_rank if node_rank is not None else _int_env(env, ENV_WORKER_INDEX)
    if rank is None:
        raise MultiNodeError(
            f"--nnodes {nnodes} needs this node's rank: --node-rank or {ENV_WORKER_INDEX} "
            "(set by LeaderWorkerSet)"
        )
    if not 0 <= rank < nnodes:
        raise MultiNodeError(f"node rank {rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    addr = master_addr or env.get(ENV_LEADER_ADDRESS, "").strip() or None
    if addr is None:
        raise MultiNodeError(
            f"--nnodes {nnodes} needs the leader's address: --master-addr or "
            f"{ENV_LEADER_ADDRESS} (set by LeaderWorkerSet)"
        )
    return Node(nnodes=nnodes, rank=rank, master_addr=addr, master_port=master_port)


def gpus_per_node(plan: Plan, nnodes: int) -> int:
    """The GPUs each node holds; :class:`MultiNodeError` when the plan does not split."""
    par = plan.parallelism
    per_engine = par.tensor_parallel_size * par.pipeline_parallel_size
    world = per_engine * par.data_parallel_size
    what = (
        f"TP {par.tensor_parallel_size} x PP {par.pipeline_parallel_size}"
        + (f" x DP {par.data_parallel_size}" if par.data_parallel_size > 1 else "")
        + f" = {world} GPUs"
    )
    if world % nnodes:
        raise MultiNodeError(
            f"{what} do not split evenly over {nnodes} nodes (--nnodes): every node must "
            "hold the same number of GPUs"
        )
    if par.data_parallel_size > 1 and par.data_parallel_size % nnodes:
        raise MultiNodeError(
            f"{what}: data parallel size {par.data_parallel_size} does not split over "
            f"{nnodes} nodes (--nnodes): every node must hold whole data-parallel engines"
        )
    return world // nnodes


def parallel_env(plan: Plan) -> dict[str, str]:
    """Environment the plan's parallelism needs in every vLLM process."""
    partition = plan.parallelism.pipeline_layer_partition
    if partition:
        return {ENV_PP_LAYER_PARTITION: ",".join(str(n) for n in partition)}
    return {}


def parallel_launch(plan: Plan, node: Node) -> tuple[list[str], dict[str, str]]:
    """vLLM's arguments and environment for this node of the plan's replica (pure).

    One node: no arguments (today's launch). Raises :class:`MultiNodeError`."""
    env = parallel_env(plan)
    if node.nnodes == 1:
        return [], env
    gpus_per_node(plan, node.nnodes)
    assert node.master_addr is not None  # node_from insists
    par = plan.parallelism
    if par.data_parallel_size > 1:
        local = par.data_parallel_size // node.nnodes
        args = [
            "--data-parallel-size-local", str(local),
            "--data-parallel-address", node.master_addr,
            "--data-parallel-rpc-port", str(node.master_port),
        ]
        if node.headless:
            args += ["--headless", "--data-parallel-start-rank", str(node.rank * local)]
        return args, env
    args = [
        "--nnodes", str(node.nnodes),
        "--node-rank", str(node.rank),
        "--master-addr", node.master_addr,
        "--master-port", str(node.master_port),
    ]
    if node.headless:
        args.append("--headless")
    return args, env


#: How long a headless rank waits for its leader's port: the leader binds it when its
#: engine starts, after the API server's start-up and the model config's download.
LEADER_WAIT_S = 900.0


def _tcp_connect(host: str, port: int, timeout: float) -> None:
    socket.create_connection((host, port), timeout=timeout).close()


def wait_for_leader(
    node: Node,
    timeout_s: float = LEADER_WAIT_S,
    *,
    connect: Callable[[str, int, float], None] = _tcp_connect,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    interval_s: float = 2.0,
) -> float:
    """Block until the leader's rendezvous port takes a TCP connection; the seconds
    waited. :class:`MultiNodeError` after ``timeout_s``: a worker that cannot reach its
    leader would otherwise hang in torch.distributed's rendezvous for good."""
    assert node.master_addr is not None
    start = clock()
    last = "no attempt"
    while True:
        try:
            connect(node.master_addr, node.master_port, min(5.0, interval_s * 2))
            return clock() - start
        except OSError as e:  # not resolvable yet, refused, unreachable
            last = f"{type(e).__name__}: {e}"
        waited = clock() - start
        if waited >= timeout_s:
            raise MultiNodeError(
                f"node rank {node.rank} cannot reach its leader at "
                f"{node.master_addr}:{node.master_port} after {waited:.0f} s ({last}): the "
                f"group's pods must reach each other on port {node.master_port} (container "
                f"port 'dist'; a NetworkPolicy must allow it) and {ENV_LEADER_ADDRESS} must "
                "resolve (LeaderWorkerSet's headless Service)"
            )
        sleep(interval_s)
