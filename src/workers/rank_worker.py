"""One rank of a tensor-parallel engine, as a process.

``python -m legato.workers.rank_worker --rank R --world-size W --local-rank L
--master-addr HOST --master-port PORT``

Rank 0 is the engine's peer: it speaks the worker protocol of
:mod:`legato.workers.worker` on stdin / stdout, and hosts the rendezvous store (a
torch.distributed ``TCPStore`` at ``HOST:PORT``). The other ranks, on this
host or on others (``legato worker``), connect to that store. Start-up:

1. rank 0 reads WorkerInit from stdin and puts it in the store; the others
   read it from there (so a remote node needs no model arguments);
2. every rank joins the process group (:func:`~legato.models.process_group.join_group`,
   with :func:`collective_timeout` as every collective's timeout), loads its share
   of the model, and puts its WorkerReady, or a WorkerError, in the store;
3. rank 0 waits for every rank's entry: the first error fails start-up with
   that rank's message (rank 0 answers WorkerError and exits; the store goes
   with it, and the other ranks exit), else it answers one WorkerReady (the
   smallest KV cache of any rank) and lets the others go.

Serving: for each step frame, utility call and health ping, rank 0 first
broadcasts the frame's bytes to every rank (msgpack, on the gloo control
group), then every rank handles it: every rank runs the same step, only rank
0's answer goes back to the engine, except for a utility call: rank 0 gathers
every rank's answer (msgpack bytes on the gloo group, :func:`every_rank_result`),
so ``collective_rpc`` gets every rank's result, in rank order, and a rank's
failure. A health ping is also a barrier, so rank 0's pong means that every
rank is alive. When the engine closes rank 0's stdin, rank 0 broadcasts an
empty frame and every rank exits 0 (at once, see :func:`leave`). A rank whose
step fails exits non-zero; the others then fail in their next collective
(a peer gone, or the group's timeout), so a dead or stopped rank always
ends the engine: the engine also watches its local ranks' processes, and its
heartbeat's ping to rank 0 stops being answered.

Never imports trio.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from ..protocol import messages as m
from ..protocol import wire
from .worker import Worker, serve

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 900.0  # seconds a rank waits at the store (others loading, a slow node)
# Seconds an idle rank waits for rank 0's next frame. Not a user's wait: rank 0 sends
# a ping at every heartbeat, and a rank 0 that is gone closes its connections (a
# stopped one is killed by the engine).
IDLE_WAIT = 24 * 3600.0
INIT_KEY = "legato/init"
GO_KEY = "legato/go"
_BROADCAST = (m.SchedulerOutput, m.GrammarBitmask, m.UtilityCall, m.HealthPing)


_W = TypeVar("_W", bound="RankWorker")


def collective_timeout(heartbeat_interval: float, heartbeat_timeout: float) -> float:
    """Every collective's timeout: past the heartbeat's own bound (the next ping's
    interval and its timeout, twice over), so that the heartbeat reports a stopped
    rank, and the collective's timeout is only the backstop (a rank whose rank 0
    hangs, on a node the heartbeat does not reach), never torch's 30 minutes."""
    return heartbeat_interval + 2 * heartbeat_timeout


def ready_key(rank: int) -> str:
    return f"legato/ready/{rank}"


@dataclass(frozen=True)
class RankAddress:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def command(self) -> list[str]:
        """The command line that runs this rank."""
        return [
            sys.executable, "-m", "legato.workers.rank_worker",
            "--rank", str(self.rank), "--world-size", str(self.world_size),
            "--local-rank", str(self.local_rank),
            "--master-addr", self.master_addr, "--master-port", str(self.master_port),
        ]  # fmt: skip


class RankWorker(Worker):
    """A rank's Worker, and the group it joined (set once it has joined)."""

    group: Any = None  # the TensorParallelGroup
    store: Any = None  # the rendezvous store (rank 0 hosts it: it lives as long as this)


class RankZeroWorker(RankWorker):
    """Rank 0's Worker: every frame the other ranks must see is broadcast first;
    its WorkerReady speaks for every rank."""

    every_rank_ready: m.WorkerReady | None = None

    def ready(self) -> m.WorkerReady:
        return self.every_rank_ready or super().ready()

    def handle(self, message: object) -> object:
        if isinstance(message, _BROADCAST):
            self.group.broadcast_bytes(wire.encode(message))
            if isinstance(message, m.HealthPing):
                self.group.barrier()
        answer = super().handle(message)
        if isinstance(message, m.UtilityCall):
            assert isinstance(answer, m.UtilityResult)
            return every_rank_result(answer, self.group.gather_bytes(wire.encode(answer)))
        return answer


def every_rank_result(own: m.UtilityResult, gathered: list[bytes]) -> m.UtilityResult:
    """Rank 0's answer to a utility call, carrying every rank's result in rank order
    (``rank_results``); if a rank failed, the first failing rank's error, naming it.
    A rank whose answer does not decode is a broken rank: WireError, fatal."""
    answers = [own, *(wire.decode(data, expected=m.UtilityResult) for data in gathered[1:])]
    merged = m.UtilityResult(
        own.call_id, own.result, rank_results=[answer.result for answer in answers]
    )
    for rank, answer in enumerate(answers):
        if answer.error is not None:
            prefix = f"rank {rank}: " if rank else ""
            merged.error = prefix + answer.error
            merged.error_field, merged.error_reason = answer.error_field, answer.error_reason
            merged.rank_results = None
            break
    return merged


def _rank_faults(init: m.WorkerInit, rank: int) -> m.WorkerInit:
    """The chaos faults aimed at ``rank`` (``inject_fault["rank"]``, default 0) only."""
    spec = init.inject_fault
    if spec is None or int(spec.get("rank", 0)) == rank:
        return init
    return m.WorkerInit(config=init.config, inject_fault=None)


_STORE_LISTENERS: list[socket.socket] = []  # rank 0's store socket: open as long as the store


def _store_listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``host`` only: torch's TCPStore, left to bind itself, listens
    on every interface whatever ``master_addr`` says (an unauthenticated store open to
    the network)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen(128)
    _STORE_LISTENERS.append(sock)
    return sock


def _store(address: RankAddress) -> Any:
    from torch._C._distributed_c10d import TCPStore

    listen_fd = None
    if address.rank == 0:
        listen_fd = _store_listener(address.master_addr, address.master_port).fileno()
    return TCPStore(
        address.master_addr,
        address.master_port,
        address.world_size,
        is_master=address.rank == 0,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _join_and_load(init: m.WorkerInit, store: Any, address: RankAddress, cls: type[_W]) -> _W:
    """Join the group and load this rank's share; returns the Worker. Raises what failed."""
    import torch

    from ..config import EngineConfig
    from ..models.config import resolve_device
    from ..models.process_group import join_group
    from ..models.tensor_parallel import TensorParallel

    config = EngineConfig(**init.config)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", address.local_rank)
        torch.cuda.set_device(device)
    group = join_group(
        store,
        rank=address.rank,
        world_size=address.world_size,
        device=device,
        timeout=collective_timeout(config.heartbeat_interval, config.heartbeat_timeout),
    )
    worker = cls.start(_rank_faults(init, address.rank), TensorParallel(group))
    worker.group, worker.store = group, store
    return worker


def start_rank_zero(init: m.WorkerInit, address: RankAddress) -> RankZeroWorker:
    """Rank 0's start-up (see the module docstring); raises with the failing rank's error."""
    store = _store(address)
    store.set(INIT_KEY, wire.encode(init))
    worker = _join_and_load(init, store, address, RankZeroWorker)
    ready = worker.ready()
    for rank in range(1, address.world_size):
        entry = wire.decode(store.get(ready_key(rank)))
        if isinstance(entry, m.WorkerError):
            raise RuntimeError(
                f"tensor-parallel rank {rank} failed to start: {entry.error_type}: {entry.message}"
            )
        if not isinstance(entry, m.WorkerReady):
            raise RuntimeError(f"tensor-parallel rank {rank} sent {type(entry).__name__}")
        ready.num_kv_blocks = min(ready.num_kv_blocks, entry.num_kv_blocks)
        ready.max_model_len = min(ready.max_model_len, entry.max_model_len)
    store.set(GO_KEY, b"go")
    worker.every_rank_ready = ready
    return worker


def serve_rank_zero(inp: BinaryIO, out: BinaryIO, address: RankAddress) -> int:
    """Serve the engine's frames as rank 0; returns the exit code."""
    workers: list[RankZeroWorker] = []

    def start(init: m.WorkerInit) -> Worker:
        worker = start_rank_zero(init, address)
        workers.append(worker)
        return worker

    code = serve(inp, out, start)
    if code == 0 and workers:
        workers[0].group.broadcast_bytes(b"")  # the others exit
    return code


def serve_other_rank(address: RankAddress) -> int:
    """Start-up and serving for a rank other than 0; returns the exit code."""
    store = _store(address)
    init = wire.decode(store.get(INIT_KEY))
    if not isinstance(init, m.WorkerInit):
        raise RuntimeError(f"the store's init entry is a {type(init).__name__}")
    try:
        worker = _join_and_load(init, store, address, RankWorker)
    except Exception as exc:
        traceback.print_exc()
        store.set(ready_key(address.rank), wire.encode(m.WorkerError(str(exc), type(exc).__name__)))
        store.get(GO_KEY)  # rank 0 reports the error; this returns or raises once it is gone
        return 1
    store.set(ready_key(address.rank), wire.encode(worker.ready()))
    if store.get(GO_KEY) != b"go":
        return 1
    group = worker.group
    while True:
        data = group.broadcast_bytes(None, wait=IDLE_WAIT)
        if not data:
            return 0
        message = wire.decode(data)
        if isinstance(message, m.HealthPing):
            group.barrier()
            continue
        answer = worker.handle(message)  # raises on a fatal error: the process exits non-zero
        if isinstance(message, m.UtilityCall):  # rank 0 gathers every rank's answer
            group.gather_bytes(wire.encode(answer))


def parse_args(argv: list[str] | None = None) -> RankAddress:
    parser = argparse.ArgumentParser(prog="python -m legato.workers.rank_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv)
    return RankAddress(
        args.rank, args.world_size, args.local_rank, args.master_addr, args.master_port
    )


def leave(code: int) -> None:
    """Exit with ``code`` without running torch's C++ teardown.

    Once every rank has agreed to stop, the ranks leave at the same moment: rank
    0 takes the rendezvous store with it while another rank's destructors still
    talk to it, and gloo's threads die with ``std::terminate`` (exit -6 instead of
    the 0 just decided). Nothing is left to tidy: flush the streams and go.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    address = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LEGATO_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s rank {address.rank} %(levelname)s %(name)s: %(message)s",
    )
    threads = os.environ.get("LEGATO_WORKER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    if address.rank != 0:
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        leave(serve_other_rank(address))
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt frames
    try:
        code = serve_rank_zero(inp, out, address)
    except wire.WireError as exc:
        print(f"legato rank 0: bad frame from the engine: {exc}", file=sys.stderr)
        code = 2
    with contextlib.suppress(OSError, ValueError):  # the engine may be gone
        out.flush()
    leave(code)


if __name__ == "__main__":
    main()
