"""``LLMEngine.model_executor``: vLLM's in-process executor over legato's in-process Worker.

vLLM's ``LLMEngine.model_executor`` (a ``UniProcExecutor``) is how code reaches
the one worker: ``model_executor.driver_worker.worker.model_runner.model`` (or
``driver_worker.model_runner.model``: vLLM's ``WorkerWrapperBase`` forwards to
its worker) and ``model_executor.collective_rpc(method, timeout, args, kwargs)``.
:class:`InprocModelExecutor` gives those names over legato's ``Worker``:

- ``driver_worker`` is a :class:`WorkerWrapper`: ``.worker`` is the Worker,
  and every other attribute is the Worker's (``model_runner``, ``get_model()``);
- ``collective_rpc`` calls a callable as vLLM does, ``method(driver_worker,
  *args, **kwargs)``; a name calls that public method of the model runner (or
  the worker's own profiler and weight-update calls, see
  ``Worker.call_utility``), vLLM's names on vLLM's worker being another set;
  one result in a list (``single_value``: the result itself);
- ``check_health`` returns (an in-process worker is healthy while it runs).

Where legato differs: ``runner.model`` is legato's module (``load_weights``
takes vLLM's ``(name, tensor)`` pairs); on the CPU, linears keep packed copies
of their weights, so new weights go in through ``update_weights`` /
``runner.reload_weights``, not by writing parameters in place.

Never imports trio; torch only through the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..workers.worker import Worker


class WorkerWrapper:
    """vLLM's ``WorkerWrapperBase``: ``worker`` is the Worker; other attributes are its."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class InprocModelExecutor:
    """vLLM's ``UniProcExecutor`` names over one in-process Worker (see the module)."""

    def __init__(self, worker: Worker, call: Callable[..., Any]) -> None:
        """``call(method, *args, **kwargs)``: the engine's call of a runner method by name
        (its checks and errors: ``LLMEngine._call``)."""
        self.driver_worker = WorkerWrapper(worker)
        self._call = call

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        """vLLM's: ``method`` on the one worker, in this thread (``timeout`` bounds nothing
        here, as in vLLM's in-process executor); ``[result]``, or the result itself with
        ``single_value``. ``non_block`` is refused: nothing runs in the background."""
        if non_block:
            raise ValueError("non_block: the in-process executor runs every call in this thread")
        if callable(method):
            result = method(self.driver_worker, *args, **(kwargs or {}))
        else:
            result = self._call(method, *args, **(kwargs or {}))
        return result if single_value else [result]

    def check_health(self) -> None:
        """vLLM's: an in-process worker is healthy as long as it runs."""
