"""``EngineControls``: the calls that steer the engine rather than a request.

Pause and resume, sleep and wake-up, the caches, LoRA adapters, the profiler
and ``collective_rpc``: each either queues a typed operation that the engine
core's loop carries out (``EngineCore.pause`` ...) or calls the worker through
the executor. A mixin of ``AsyncEngine``, which sets the attributes declared
here when it starts.

Trio: every async call here is a checkpoint. A caller cancelled while waiting
stops waiting; the operation still completes (the core carries out every
queued operation whole; the worker finishes its call). A dead engine raises
its ``EngineDeadError``.

Never imports models, the worker side or torch.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import trio

from ..actors.engine_core import CoreStopped, EngineCore
from ..actors.executor import WorkerCallError, WorkerDiedError
from ..config import EngineConfig
from ..engine_adapters import EngineAdapters
from ..protocol.client import PauseModeName
from ..protocol.params import LoRARequest
from ..scheduling.pause_gate import PauseMode
from ..scheduling.scheduler import Scheduler
from .lifecycle import EngineLifecycle

logger = logging.getLogger("legato.engine")

T = TypeVar("T")

PAUSE_MODES = {"abort": PauseMode.ABORT, "wait": PauseMode.WAIT, "keep": PauseMode.KEEP}


class EngineControls(EngineLifecycle):
    """Mixin: the engine's control calls, over its core, scheduler, executor and adapters."""

    config: EngineConfig
    adapters: EngineAdapters
    core: EngineCore  # set at start-up
    scheduler: Scheduler  # set at start-up

    # ------------------------------------------------------ pause and sleep

    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None:
        """Stop generating. New requests are accepted and held until resume. Idempotent.

        "abort": in-flight requests end with reason "abort"; "wait": returns
        once they have finished; "keep": they freeze and continue on resume.
        ``wait_for_inflight_requests=True`` is vLLM's older spelling of "wait".
        ``clear_cache`` resets the prefix cache once nothing is in flight.
        A caller cancelled while waiting stops waiting; the pause goes on.
        """
        if wait_for_inflight_requests:
            mode = "wait"
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._check_alive()
        await self._control(self.core.pause(PAUSE_MODES[mode], clear_cache))

    async def resume_generation(self) -> None:
        self._check_alive()
        await self._control(self.core.resume())

    async def is_paused(self) -> bool:
        await trio.lowlevel.checkpoint()
        return self.scheduler.is_paused

    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None:
        """Free the KV cache (level 2: also the weights); new requests are held until ``wake_up``.

        In-flight requests are aborted ("abort"), first allowed to finish ("wait"),
        or frozen ("keep", as vLLM's): they continue after ``wake_up``, recomputing
        the KV cache sleep freed from their tokens so far. A caller cancelled while
        waiting stops waiting; the engine still goes to sleep.
        """
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._check_alive()
        await self._control(self.core.sleep(level, PAUSE_MODES[mode]))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed (``tags``: None = everything, else a subset of
        "weights" and "kv_cache"); held requests start once the KV cache is back."""
        if tags is not None:
            unknown = sorted(set(tags) - {"weights", "kv_cache"})
            if unknown:
                raise ValueError(f"tags: unknown tag(s) {unknown}; expected weights, kv_cache")
            tags = list(tags)
        self._check_alive()
        await self._control(self.core.wake_up(tags))

    async def is_sleeping(self) -> bool:
        await trio.lowlevel.checkpoint()
        return self.core.sleeping

    async def wait_until_idle(self) -> None:
        """Return once the scheduler holds no request (every KV block free). A checkpoint."""
        self._check_alive()
        await self.core.wait_idle()

    # ---------------------------------------------------------------- caches

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self._check_alive()
        return await self._control(self.core.reset_prefix_cache(reset_running_requests))

    async def reset_mm_cache(self) -> None:
        await trio.lowlevel.checkpoint()  # no multimodal inputs yet: nothing to reset

    async def reset_encoder_cache(self) -> None:
        await trio.lowlevel.checkpoint()  # no encoder cache yet: nothing to reset

    async def _control(self, call: Awaitable[T]) -> T:
        """Await one of the engine core's control calls; its answer. A checkpoint.

        The loop does the whole of it even if this caller is cancelled while
        waiting (it just stops waiting). If the engine dies or stops first,
        raises its EngineDeadError.
        """
        try:
            return await call
        except CoreStopped:
            self._check_alive()
            raise

    # ----------------------------------------------------------- the worker

    async def _worker_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the worker (every rank); rank 0's result. A checkpoint. A
        cancelled caller stops waiting (the call still runs on the worker); if the
        worker dies, raises the engine's EngineDeadError."""
        return (await self._every_rank(method, args, kwargs, every_rank=False))[0]

    async def _every_rank(
        self, method: str, args: Sequence[Any], kwargs: dict[str, Any], *, every_rank: bool = True
    ) -> list[Any]:
        self._check_alive()
        executor = self.executor
        try:
            if every_rank:
                return await executor.call_every_rank(method, *args, **kwargs)
            return [await executor.call(method, *args, **kwargs)]
        except WorkerDiedError:
            self._check_alive()
            raise

    async def start_profile(self) -> None:
        trace_dir = self.config.profile_dir or os.path.join(os.getcwd(), "legato-profile")
        await self._worker_call("start_profile", trace_dir)

    async def stop_profile(self) -> None:
        path = await self._worker_call("stop_profile")
        logger.info("profiler trace written to %s", path)

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a PEFT adapter on the worker (blocks the caller while it reads); True.

        Requests name it by ``lora_request`` (Python) or by its ``lora_name``
        as the model (HTTP). An adapter the engine cannot serve (bad path, a
        rank above max_lora_rank, an unknown module...) raises ValidationError
        naming the field; the engine lives. See legato.engine_adapters.
        """
        self._check_alive()
        return await self.adapters.add(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""
        self._check_alive()
        return await self.adapters.remove(lora_id)

    async def list_loras(self) -> set[int]:
        """The int ids of the loaded adapters. A checkpoint."""
        await trio.lowlevel.checkpoint()
        return self.adapters.ids()

    def loaded_loras(self) -> list[LoRARequest]:
        """The loaded adapters, by int id (see ``EngineClient.loaded_loras``)."""
        return self.adapters.loaded()

    async def pin_lora(self, lora_id: int) -> bool:
        """Exempt a loaded adapter from LRU eviction; False if it is not loaded."""
        self._check_alive()
        return await self.adapters.pin(lora_id)

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker; their results in a list, in rank order.

        As vLLM's: one result per tensor-parallel rank (one without tensor
        parallelism); a method that raises on any rank fails the call with
        vLLM's ``RuntimeError("Worker failed with error '...'")`` (the message
        names the rank; the engine keeps serving), and no answer within
        ``timeout`` seconds raises vLLM's ``TimeoutError("RPC call to ... timed
        out.")`` (the call still completes on the workers). A dead engine raises
        its EngineDeadError. Unlike vLLM: ``method`` is a name (public model runner
        methods and the worker's own), never a callable, and arguments and results
        are msgpack data: nothing is pickled across the process boundary.
        """
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                return await self._every_rank(method, args, kwargs or {})
        except WorkerCallError as exc:
            raise RuntimeError(
                f"Worker failed with error '{exc}', please check the stack trace above for "
                "the root cause"
            ) from exc
        except trio.TooSlowError:
            raise TimeoutError(f"RPC call to {method} timed out.") from None
