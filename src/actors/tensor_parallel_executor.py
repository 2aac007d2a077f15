"""The tensor-parallel executor: one worker process per rank, every one supervised.

``TensorParallelExecutor`` is the process executor whose worker is rank 0 of a
torch.distributed group (``legato.workers.rank_worker``): the engine
speaks the worker protocol to rank 0 only, and rank 0 hands every frame to the
other ranks (see that module). This executor also starts the other ranks of
this node (node 0: ranks ``1 .. tensor_parallel_size / nnodes - 1``; the other
nodes' ranks come from ``legato worker``) and watches them:

- a local rank that exits ends the engine at once (``WorkerDiedError``: the
  supervisor's cause; every waiting caller gets it), also during start-up
  (``EngineStartupError``, after rank 0 had a few seconds to report the
  failing rank's own error, which names the cause better);
- a rank that hangs or is stopped blocks rank 0 in its next collective, and
  so the heartbeat's ping (rank 0 answers a ping only after a barrier of
  every rank): ``HeartbeatTimeout`` within ``heartbeat_timeout``; every
  collective's own timeout is a little longer (the backstop), never torch's
  30 minutes;
- every local rank is reaped when the executor stops, however it stops
  (SIGKILL to its process group when it does not exit by itself).

Started like the process executor: ``await nursery.start(executor.run)``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any

import trio

from ..config import EngineConfig
from ..exception_groups import unwrap_single_error
from ..protocol import messages as m
from ..protocol.errors import EngineStartupError
from ..workers.rank_worker import RankAddress
from .executor import OnFailure, WorkerDiedError
from .process_executor import FORCED_GRACE, ProcessExecutor, _cpu_threads, reap_process

_STARTUP_GRACE = 5.0  # seconds rank 0 has to report why a rank failed to start


def rank_env(ranks_on_node: int) -> dict[str, str]:
    """A rank's environment: this host's cores shared among its ranks."""
    env = dict(os.environ)
    env.setdefault("LEGATO_WORKER_THREADS", str(max(1, _cpu_threads() // ranks_on_node)))
    return env


def free_port(host: str) -> int:
    """A TCP port nothing listens on at ``host`` now (rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class TensorParallelExecutor(ProcessExecutor):
    """Rank 0 as the process executor's worker, and this node's other ranks beside it.

    See the module docstring.
    """

    # Rank 0's own failure (often a collective cut short by a peer that died) names it.
    worker_name = "tensor-parallel rank 0"

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_failure: OnFailure | None = None,
        inject_fault: dict[str, Any] | None = None,
    ):
        if config.node_rank != 0:
            raise ValueError(
                "node_rank: the engine runs on node 0; start the other nodes with `legato worker`"
            )
        super().__init__(config, on_failure=on_failure, inject_fault=inject_fault)
        self._ranks_on_node = config.tensor_parallel_size // config.nnodes
        self._port = config.master_port or free_port(config.master_addr)
        self._others: dict[int, trio.Process] = {}  # rank -> process, this node's ranks but 0
        self._started = trio.Event()
        self._graceful = False  # begin_shutdown was called: the ranks may exit by themselves

    @property
    def rank_pids(self) -> list[int | None]:
        """This node's rank processes' pids, rank 0 first."""
        return [self.pid, *(p.pid for p in self._others.values())]

    def _worker_command(self) -> list[str]:
        return self._rank_command(0)

    def _rank_command(self, rank: int) -> list[str]:
        config = self._config
        address = RankAddress(
            rank, config.tensor_parallel_size, rank, config.master_addr, self._port
        )
        return address.command()

    def _worker_env(self) -> dict[str, str]:
        return rank_env(self._ranks_on_node)

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start every local rank, report rank 0's WorkerReady (it speaks for every
        rank), then serve until shutdown. Raises as the process executor does, and
        ``WorkerDiedError`` / ``EngineStartupError`` for a local rank that exits.
        Always reaps every local rank, also when cancelled."""
        try:
            for rank in range(1, self._ranks_on_node):
                self._others[rank] = await trio.lowlevel.open_process(
                    self._rank_command(rank),
                    stdin=subprocess.DEVNULL,
                    env=rank_env(self._ranks_on_node),
                    start_new_session=True,
                )
            with unwrap_single_error():
                async with trio.open_nursery() as nursery:
                    for rank, process in self._others.items():
                        nursery.start_soon(self._watch_rank, rank, process)
                    ready = await nursery.start(self._run_rank_zero, nursery.cancel_scope)
                    self._started.set()
                    task_status.started(ready)
        finally:
            with trio.CancelScope(shield=True):
                for process in self._others.values():
                    await reap_process(
                        process, grace=self._grace if self._graceful else FORCED_GRACE
                    )

    async def _run_rank_zero(
        self,
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The process executor's run (rank 0); once it ends, the watchers stop too."""
        await ProcessExecutor.run(self, task_status=task_status)
        scope.cancel()

    async def _watch_rank(self, rank: int, process: trio.Process) -> None:
        """Raise once rank ``rank``'s process exits, unless the executor is closing."""
        code = await process.wait()
        if self._closing:
            return
        if not self._started.is_set():
            # Rank 0 fails too (a peer gone) and its report names the cause: the
            # failing rank's own error. The nursery cancels this wait when it arrives.
            with trio.move_on_after(_STARTUP_GRACE):
                await self._started.wait()
            if not self._started.is_set():
                raise EngineStartupError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code} "
                    "during start-up"
                )
        error = WorkerDiedError(
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}"
        )
        self._fail_waiting(error)
        if self.on_failure is not None:
            self.on_failure(error)
        raise error

    def begin_shutdown(self, grace: float | None = None) -> None:
        super().begin_shutdown(grace)
        self._graceful = True

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank``'s process on this node (chaos testing)."""
        if rank == 0:
            self.kill(sig)
            return
        process = self._others[rank]
        if process.returncode is None:
            os.kill(process.pid, sig)
