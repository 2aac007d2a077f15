"""The tensor-parallel rendezvous store listens on ``master_addr`` only (F18): torch's
TCPStore, left to bind itself, listens on every interface."""

from __future__ import annotations

import os
import socket

import psutil

from legato.workers.rank_worker import RankAddress, _store


def _listening(port: int) -> set[str]:
    connections = psutil.Process(os.getpid()).net_connections()
    return {c.laddr.ip for c in connections if c.status == "LISTEN" and c.laddr.port == port}


def test_rank_zeros_store_listens_on_master_addr_only() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    store = _store(RankAddress(0, 1, 0, "127.0.0.1", port))
    assert _listening(port) == {"127.0.0.1"}
    store.set("k", b"v")
    assert store.get("k") == b"v"
