"""``EngineWeightUpdates``: vLLM's weight-update calls (RL training) on a running engine.

As vLLM's ``AsyncLLM``, each call is a ``collective_rpc`` to every worker
(every tensor-parallel rank): ``init_weight_transfer_engine(request)``,
``start_weight_update()``, ``update_weights(request)`` (its ``update_info``),
``finish_weight_update(weight_version)``, plus ``update_weight_version`` and
``get_weight_version``. The worker side is vLLM's "disk" backend
(:mod:`legato.workers.weight_transfer`): ``update_info={"path": "/abs/dir"}``
loads a checkpoint of the same architecture, between two steps, on every rank;
the next step runs on it. A failure raises vLLM's RuntimeError ("Worker failed
with error ..."); the engine keeps serving. vLLM's trainer-streamed transports
(NCCL, IPC) are not supported.

As with vLLM, requests in flight are not paused for you: a caller that wants
no request to mix old and new weights pauses generation around the update
(``pause_generation`` ... ``resume_generation``), and resets the prefix cache
(``clear_cache=True``), whose blocks were computed with the old weights.

A mixin of ``AsyncEngine``. Never imports models, the worker side or torch.
"""

from __future__ import annotations

from typing import Any

import trio

from ..protocol.client import WeightTransferInitRequest, WeightTransferUpdateRequest
from .controls import EngineControls


class EngineWeightUpdates(EngineControls):
    """Mixin: vLLM's weight-update calls over ``collective_rpc``."""

    _weight_version: str | None = None

    async def init_weight_transfer_engine(self, init_request: WeightTransferInitRequest) -> None:
        """vLLM's: set up the weight transfer (the disk backend takes no init info)."""
        info = _info(init_request, "init_info")
        await self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """vLLM's: begin an update session (checkpoint format only)."""
        kwargs = {"is_checkpoint_format": is_checkpoint_format}
        await self.collective_rpc("start_weight_update", kwargs=kwargs)

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        """vLLM's: load ``request.update_info["path"]`` on every rank (see the module)."""
        info = _info(request, "update_info")
        await self.collective_rpc("update_weights", kwargs={"update_info": info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM's: end the session; record ``weight_version`` if given."""
        await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        """vLLM's: record the weights' version without changing them. A checkpoint."""
        await trio.lowlevel.checkpoint()
        self._weight_version = new_version

    async def get_weight_version(self) -> str:
        """vLLM's: the last recorded version ("" if none was). A checkpoint."""
        await trio.lowlevel.checkpoint()
        return self._weight_version or ""


def _info(request: object, name: str) -> dict[str, Any]:
    """``request.<name>`` (vLLM's request object), or ``request`` itself as a dict."""
    info = getattr(request, name, request)
    if not isinstance(info, dict):
        raise TypeError(f"{name}: expected a dict or a request carrying one, got {info!r}")
    return info
