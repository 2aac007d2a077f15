"""One rank's membership of the engine's tensor-parallel group, and its collectives.

:func:`join_group` joins the torch.distributed process group of one engine
(gloo on CPU, NCCL on CUDA) through the engine's TCPStore, with an explicit
timeout: a collective that waits longer than ``timeout`` seconds for a peer
fails (gloo raises; NCCL's watchdog tears the process down), so torch's
30-minute default is never what anyone waits for. Every rank process joins
one group, once, and stays in it until it exits.

:class:`TensorParallelGroup` is what the model's parallel layers and the rank
workers call: an in-place sum (``all_reduce``), a gather of every rank's
columns (``all_gather_columns``), and on a gloo group of CPU tensors (the
same group on CPU, a second one beside NCCL) the control plane: rank 0's
frames to the other ranks (``broadcast_bytes``), their answers back
(``gather_bytes``) and ``barrier``. Each call
blocks until every rank has made it, in the same order: every rank must run
the same layers on the same batch.

The collectives are called on the ProcessGroup objects themselves, so a group
built without ``init_process_group`` (tests run two ranks as two threads of
one process) works the same.

Never imports trio.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

logger = logging.getLogger(__name__)

GROUP_PREFIX = "legato/group"  # the process group's keys in the engine's store


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``world_size``: ``pg`` carries the model's collectives (NCCL
    or gloo), ``ctrl`` (gloo, CPU tensors) the control plane.

    ``collective_seconds`` accumulates the wall time spent in the model's
    collectives when ``timed`` is set (benchmarks: the all-reduce share of a step).
    """

    rank: int
    world_size: int
    backend: str
    pg: Any
    ctrl: Any
    timed: bool = False
    collective_seconds: float = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            began = time.perf_counter() if self.timed else 0.0
            self.pg.allreduce([tensor]).wait()
            self._account(began)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` on every rank -> ``[N, world_size * C]``, rank 0's columns first."""
        if self.world_size == 1:
            return tensor
        began = time.perf_counter() if self.timed else 0.0
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([parts], [tensor]).wait()
        self._account(began)
        return torch.cat(parts, dim=-1)

    def _account(self, began: float) -> None:
        if self.timed:
            if self.backend == "nccl":
                torch.cuda.synchronize()
            self.collective_seconds += time.perf_counter() - began

    def broadcast_bytes(self, data: bytes | None, *, wait: float | None = None) -> bytes:
        """Rank 0 passes ``data``; every rank gets it back. Two gloo broadcasts
        (length, then bytes): no pickling. ``wait``: seconds the first may wait
        for rank 0 instead of the group's timeout (an idle rank waiting for the
        next frame)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if wait is not None:
            opts.timeout = datetime.timedelta(seconds=wait)
        self.ctrl.broadcast([size], opts).wait()
        length = int(size.item())
        if length == 0:
            return b""
        if data is not None:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        self.ctrl.broadcast([buffer], opts).wait()
        return data if data is not None else buffer.numpy().tobytes()

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank passes its ``data``; every rank gets all of them, in rank order.

        Two gloo all-gathers on the control group (lengths, then the bytes padded to
        the longest): no pickling. Rank 0 gathers the ranks' answers to a utility
        call this way."""
        if self.world_size == 1:
            return [data]
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        self.ctrl.allgather([sizes], [size]).wait()
        lengths = [int(s.item()) for s in sizes]
        buffer = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
        if data:
            buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buffer) for _ in range(self.world_size)]
        self.ctrl.allgather([parts], [buffer]).wait()
        return [part[:n].numpy().tobytes() for part, n in zip(parts, lengths, strict=True)]

    def barrier(self) -> None:
        """Return once every rank has called it (a one-element sum on the control group)."""
        self.ctrl.allreduce([torch.zeros(1)]).wait()


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(
    store: Any,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: float,
) -> TensorParallelGroup:
    """Join the engine's process group through ``store`` (a ``torch.distributed.Store``).

    Blocks until every rank has joined, at most ``timeout`` seconds
    (RuntimeError / DistStoreError then); ``timeout`` is also every later
    collective's. On CUDA, ``device`` must be the rank's own GPU (set as the
    current device before this call).
    """
    backend = backend_for(device)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    span = datetime.timedelta(seconds=timeout)
    dist.init_process_group(
        backend,
        store=PrefixStore(GROUP_PREFIX, store),
        rank=rank,
        world_size=world_size,
        timeout=span,
        **kwargs,
    )
    pg = dist.group.WORLD
    ctrl = dist.new_group(backend="gloo", timeout=span) if backend == "nccl" else pg
    logger.info("rank %d of %d joined the %s group", rank, world_size, backend)
    return TensorParallelGroup(rank=rank, world_size=world_size, backend=backend, pg=pg, ctrl=ctrl)


def gloo_group(store: Any, *, rank: int, world_size: int, timeout: float) -> TensorParallelGroup:
    """A gloo group through ``store`` without touching torch.distributed's global state
    (several ranks may live in one process: tests)."""
    pg = dist.ProcessGroupGloo(
        PrefixStore(GROUP_PREFIX, store), rank, world_size, datetime.timedelta(seconds=timeout)
    )
    return TensorParallelGroup(rank=rank, world_size=world_size, backend="gloo", pg=pg, ctrl=pg)
