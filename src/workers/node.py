"""``legato worker``: the ranks of one node other than the engine's.

A tensor-parallel engine of ``tensor_parallel_size`` ranks over ``nnodes``
hosts runs ranks ``node_rank * per_node .. (node_rank + 1) * per_node - 1`` on
each; node 0 is the engine's (``legato serve ... --node-rank 0``), every other
node runs :func:`run_node`. Its ranks find rank 0 through the rendezvous store
at ``master_addr:master_port`` and take the model and engine arguments from
there, so they need no other argument (the model path must name the same
files on every node).

:func:`run_node` starts the node's ranks as child processes and waits for
them. Its exit code is that of the first rank that fails (the others are then
killed), or 0 once every rank has exited 0 (the engine shut down). SIGINT and
SIGTERM kill the ranks and exit. Never imports trio or torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

from .rank_worker import RankAddress


def node_ranks(tensor_parallel_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks that node ``node_rank`` runs; ValueError naming the bad field."""
    if tensor_parallel_size < 1 or nnodes < 1 or tensor_parallel_size % nnodes:
        raise ValueError(f"nnodes: {nnodes} nodes cannot share {tensor_parallel_size} ranks evenly")
    if not 0 < node_rank < nnodes:
        raise ValueError(
            f"node_rank: a worker node is 1..{nnodes - 1} (node 0 runs the engine), got {node_rank}"
        )
    per_node = tensor_parallel_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_node(
    tensor_parallel_size: int, nnodes: int, node_rank: int, master_addr: str, master_port: int
) -> int:
    """Run this node's ranks until they exit; returns the exit code. Blocks."""
    ranks = node_ranks(tensor_parallel_size, nnodes, node_rank)
    env = dict(os.environ)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.setdefault("LEGATO_WORKER_THREADS", str(max(1, (cores or 1) // len(ranks))))
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for local, rank in enumerate(ranks):
            address = RankAddress(rank, tensor_parallel_size, local, master_addr, master_port)
            child = subprocess.Popen(address.command(), env=env, stdin=subprocess.DEVNULL)
            processes[child.pid] = child
        remaining = set(processes)
        while remaining:
            pid, status = os.wait()
            if pid not in remaining:
                continue
            remaining.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            processes[pid].returncode = code
            if code != 0:
                print(f"legato worker: a rank (pid {pid}) exited with code {code}", file=sys.stderr)
                return 1
        return 0
    finally:
        for child in processes.values():
            if child.returncode is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
