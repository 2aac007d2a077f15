"""The scheduler's book of unfinished requests: who is waiting, who runs, who is held.

:class:`RequestBook` is the state half of :class:`~.scheduler.Scheduler` (its
base class): the requests by id, the waiting queue and the running list, the
block pool they hold, the pause gate, and the calls that change membership
without planning a step: ``add_request``, ``finish_requests``, ``abort``,
``fail``, ``pause`` / ``resume`` / ``abort_in_flight``, and the figures
(``make_stats``). The policy that plans steps and applies their answers is the
``Scheduler``'s. Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..protocol.messages import EngineCoreOutput, EngineRequest, FinishReason, SchedulerStats
from .kv_cache import KVCacheManager
from .lora_admission import AdapterLimit, requests_per_adapter
from .pause_gate import PauseGate, PauseMode
from .request_queue import RequestQueue
from .request_state import Request, RequestStatus
from .scheduler_counters import SchedulerCounters

if TYPE_CHECKING:
    from ..structured.grammar import GrammarState


class RequestBook:
    """The unfinished requests and the blocks they hold (see the module docstring).

    Raises ValueError for a config that is not resolved, or whose
    ``max_model_len`` does not fit in the KV cache alone.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.max_model_len is None or config.num_kv_blocks is None:
            raise ValueError("config: max_model_len and num_kv_blocks must be resolved")
        usable_tokens = (config.num_kv_blocks - 1) * config.block_size
        if config.max_model_len > usable_tokens:
            raise ValueError(
                f"max_model_len: {config.max_model_len} tokens do not fit in "
                f"{config.num_kv_blocks - 1} usable KV blocks of {config.block_size}"
            )
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.adapter_limit = AdapterLimit(config.max_loras if config.enable_lora else None)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # for the runner, with the next non-empty step
        self._preempted_ids: list[str] = []
        self.pause_gate = PauseGate()
        self._step_id = 0  # the last step planned
        self._seq = 0  # arrivals so far
        self._num_constrained = 0  # unfinished requests with a grammar (structured outputs)
        self.counters = SchedulerCounters()  # figures since the last make_stats()

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest, grammar: GrammarState | None = None) -> None:
        """Queue a request (``grammar``: its structured outputs' state). Raises
        ValueError (and queues nothing) for an id already in flight, an empty prompt,
        or a prompt longer than ``max_model_len``."""
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt_token_ids: must not be empty")
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {num_prompt} tokens exceed max_model_len={self.max_model_len}"
            )
        self._seq += 1
        req = Request(request, self._seq, self.max_model_len, grammar)
        self.requests[request_id] = req
        if req.grammar is not None:
            self._num_constrained += 1
        self.waiting.push(req)
        self.pause_gate.arrived()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, running or paused (held ones included)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def has_constrained_requests(self) -> bool:
        """Whether any unfinished request has a grammar (structured outputs): when none
        does, the engine core skips the per-step grammar hooks."""
        return self._num_constrained > 0

    def has_in_flight_requests(self) -> bool:
        """Whether any unfinished request is not held by a pause.

        A pause in WAIT mode is complete when this turns False: everything added
        before the pause has finished, and what arrived since waits for resume().
        """
        return len(self.requests) > self.pause_gate.num_held

    def finish_requests(
        self, request_ids: str | Iterable[str], finish_reason: FinishReason
    ) -> list[str]:
        """Finish live requests at once (e.g. a stop string the detokenizer found).

        Frees their blocks now; the runner hears of them in the next step's
        ``finished_req_ids``. Unknown or already finished ids are ignored.
        Returns the ids actually finished. Produces no output: the caller
        already knows.
        """
        return [r.request_id for r in self._finish_many(request_ids, finish_reason)]

    def abort(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Abort requests: like :meth:`finish_requests` with ``FinishReason.ABORT``.

        Idempotent. Returns one output (no tokens, ``finish_reason=ABORT``) per
        request that was live, so the engine can end the streams still listening.
        """
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ABORT,
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in self._finish_many(request_ids, FinishReason.ABORT)
        ]

    def fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish live requests with ``FinishReason.ERROR`` and their message (one request's
        grammar failed, say); one output each. Unknown or finished ids are ignored."""
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ERROR,
                num_cached_tokens=max(r.num_cached_tokens, 0),
                error=errors[r.request_id],
            )
            for r in self._finish_many(list(errors), FinishReason.ERROR)
        ]

    def _finish_many(
        self, request_ids: str | Iterable[str], finish_reason: FinishReason
    ) -> list[Request]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        waiting_ids: set[str] = set()
        any_running = False
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                any_running = True
            else:
                waiting_ids.add(request_id)
            self._release(req, finish_reason)
            finished.append(req)
        if any_running:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if waiting_ids:
            self.waiting.remove(waiting_ids)
        return finished

    def _release(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Mark finished and free the blocks; the caller removes it from its queue."""
        if req.status is RequestStatus.RUNNING:
            self._finished_ids.append(req.request_id)
        else:
            self.pause_gate.left(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        if req.grammar is not None:
            self._num_constrained -= 1

    # ---------------------------------------------------------- pausing

    def pause(self, mode: PauseMode) -> list[EngineCoreOutput]:
        """Pause generation until :meth:`resume`. Returns the abort outputs (ABORT mode).

        * ``ABORT``: abort every unfinished request now (returned as by :meth:`abort`).
        * ``WAIT``: requests added before the pause run to completion (waiting
          ones are still started); requests added during it are held.
        * ``KEEP``: freeze: :meth:`schedule` returns empty steps; nothing is lost.

        Requests added during a pause are *held*: queued, not started until
        :meth:`resume` (see :meth:`has_in_flight_requests`). Pausing again while
        paused changes the mode and keeps the first pause's boundary.
        """
        outputs = self.abort(list(self.requests)) if mode is PauseMode.ABORT else []
        self.pause_gate.pause(mode, self._seq)
        return outputs

    def abort_in_flight(self) -> list[EngineCoreOutput]:
        """Abort every unfinished request that a pause does not hold (as :meth:`abort` does).

        Held requests stay queued; they hold no blocks.
        """
        held = self.pause_gate.is_held
        return self.abort([rid for rid, req in self.requests.items() if not held(req)])

    def resume(self) -> None:
        """Leave any pause; held requests start on the next step, in policy order."""
        self.pause_gate.resume()

    @property
    def is_paused(self) -> bool:
        return self.pause_gate.mode is not None

    @property
    def pause_mode(self) -> PauseMode | None:
        return self.pause_gate.mode

    # -------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        """Current queue and cache figures, plus counts since the previous call.

        ``update_from_output`` calls it once per step, so the counts
        (prefix-cache queries / hits in tokens, preemptions, scheduled tokens)
        are normally one step's.
        """
        stats = self.counters.report(len(self.running), len(self.waiting), self.kv)
        if self.config.enable_lora:
            stats.running_lora_adapters = requests_per_adapter(self.running)
            stats.waiting_lora_adapters = requests_per_adapter(self.waiting)
        return stats
