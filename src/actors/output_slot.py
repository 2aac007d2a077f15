"""OutputSlot: where the detokenizer leaves one request's outputs for its consumer.

The producer side (``put``, ``put_error``) is synchronous and never blocks, so
one slow consumer never stalls the detokenizer or any other request: outputs
the consumer has not taken yet are merged in the slot instead of queued. The
consumer side (``get``) is a trio checkpoint. Like vLLM's
``RequestOutputCollector``.

Imports trio; never torch.
"""

from __future__ import annotations

import trio

from ..outputs.delta_merge import merge_delta_outputs
from ..protocol.outputs import RequestOutput
from ..protocol.params import RequestOutputKind


class OutputSlot:
    """The trio ``OutputSink`` (``legato.outputs.sink``): a single-consumer mailbox for one request's ``RequestOutput``s.

    ``put`` merges with the pending output the consumer has not taken yet:
    for ``DELTA`` the pieces are concatenated per completion index (text,
    token ids, logprobs) and the newest finish info, cumulative logprob and
    metrics win; for ``CUMULATIVE`` and ``FINAL_ONLY`` the newer output
    replaces the pending one (it already carries everything).

    Errors take precedence: ``put_error`` drops any pending output, and every
    later ``get`` / ``get_nowait`` raises that error (the first error put
    wins; later outputs and errors are ignored). A failed request's partial
    output is of no use, and a consumer must never miss the error.

    Nothing follows an output with ``finished=True``: a consumer stops there
    (a further ``get`` would wait until cancelled).

    ``put`` and ``put_error`` may be called outside a trio run (e.g. by a
    synchronous engine polling ``get_nowait``) as long as no task waits in
    ``get``.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.output_kind = output_kind
        self._delta = output_kind == RequestOutputKind.DELTA
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._waiter: trio.lowlevel.Task | None = None  # the consumer, parked in get
        self._getting = False

    @trio.lowlevel.enable_ki_protection
    def put(self, output: RequestOutput) -> None:
        """Leave ``output`` for the consumer, merged with any pending one. Never blocks."""
        if self._error is not None:
            return
        if self._delta:
            self._pending.append(output)  # merged lazily, by the consumer's get
        else:
            self._pending = [output]
        # _wake, inline: the detokenizer puts for every stream on every step.
        task, self._waiter = self._waiter, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def put_error(self, exc: BaseException) -> None:
        """Fail the consumer's next ``get`` (and every one after) with ``exc``. Never blocks."""
        if self._error is not None:
            return
        self._error = exc
        self._pending.clear()
        self._wake()

    @trio.lowlevel.enable_ki_protection
    def _wake(self) -> None:
        """Reschedule the parked consumer, if any. One consumer at most, so this is
        a ParkingLot's ``unpark_all`` without its per-call bookkeeping."""
        task, self._waiter = self._waiter, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    @property
    def ready(self) -> bool:
        """Whether ``get`` would return (or raise) without waiting."""
        return bool(self._pending) or self._error is not None

    def get_nowait(self) -> RequestOutput | None:
        """Take the pending output (merged), or None if there is none; raise the error if one was put."""
        if self._error is not None:
            raise self._error
        if not self._pending:
            return None
        return self._take()

    def _take(self) -> RequestOutput:
        pending, self._pending = self._pending, []
        return pending[0] if len(pending) == 1 else merge_delta_outputs(pending)

    async def get(self) -> RequestOutput:
        """Wait for the next output and take it; raise the error if one was put.

        Always a checkpoint. If cancelled, nothing is taken: the pending output
        stays for the next call. Single consumer: a second task calling ``get``
        while one waits raises ``trio.BusyResourceError``.
        """
        if self._getting:
            raise trio.BusyResourceError("another task is already waiting on this OutputSlot")
        self._getting = True
        # ``ready`` and ``get_nowait``, inline: this runs once per stream per step.
        try:
            if self._pending or self._error is not None:
                await trio.lowlevel.checkpoint()
            while not self._pending and self._error is None:
                # Park until put wakes it (inline, not a helper coroutine, for the same reason).
                self._waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        finally:
            self._getting = False
        if self._error is not None:
            raise self._error
        return self._take()

    def _abort_wait(self, _: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        """The parked consumer was cancelled: forget it (nothing is taken)."""
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED
