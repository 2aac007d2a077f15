"""The public errors, on vLLM's base classes so vLLM's ``except`` clauses catch them.

- ``EngineDeadError`` is a RuntimeError: vLLM v1's EngineDeadError is an Exception, the
  multiprocess client's ``MQEngineDeadError`` and ``LaunchEngineClient.dead_error`` are
  RuntimeErrors, so ``except RuntimeError`` and ``except Exception`` both hold.
- ``EngineGenerateError`` is an Exception, constructible with no arguments as vLLM's.
- ``ValidationError`` (bad input) is a ValueError, as vLLM's input checks raise.
- ``EngineStartupError`` is a RuntimeError, as vLLM's "Engine core initialization
  failed" is.

Never imports torch or trio.
"""

from __future__ import annotations


class LegatoError(Exception):
    """Base of every error legato raises on purpose."""


class EngineDeadError(LegatoError, RuntimeError):
    """The engine has died and cannot serve again.

    Raised by every open stream, every new call and ``check_health`` once the
    engine is dead. ``__cause__`` is the first failure that killed it.
    ``EngineDeadError()`` with no arguments works, as vLLM's does;
    ``suppress_context`` is vLLM's keyword (hide the implicit context in tracebacks).
    """

    def __init__(
        self,
        message: str = "the engine is dead; see __cause__ for why",
        *,
        suppress_context: bool = False,
    ) -> None:
        super().__init__(message)
        self.__suppress_context__ = suppress_context


class MQClientClosedError(EngineDeadError):
    """A call reached an engine that has been shut down (vLLM's multiprocess client's name).

    An EngineDeadError too: after ``shutdown()`` new requests and control calls raise
    this; ``abort`` and the properties never do. Code written for vLLM that suppresses
    ``MQClientClosedError`` around calls made while closing keeps working.
    """

    def __init__(self, message: str = "the engine has been shut down") -> None:
        super().__init__(message)


class EngineBusyError(LegatoError, RuntimeError):
    """The engine already holds as many requests as it admits (``max_live_requests``).

    Raised by ``check_admission`` and by submitting a request past the bound;
    nothing was registered, and the engine keeps serving: retry once requests
    have finished.
    """


class EngineGenerateError(LegatoError):
    """One request failed; the engine is healthy and keeps serving others.

    ``request_id`` names it when known; ``EngineGenerateError()`` with no
    arguments works, as vLLM's does.
    """

    def __init__(self, request_id: str | None = None, message: str = "the request failed") -> None:
        super().__init__(message if request_id is None else f"request {request_id!r}: {message}")
        self.request_id = request_id


class ValidationError(LegatoError, ValueError):
    """Bad input from a caller: ``field`` names the offending field (vLLM's and the
    request's own names: ``temperature``, ``structured_outputs.json``,
    ``messages[0].content``) and ``reason`` says what is wrong with it.

    ``str()`` is ``"field: reason"``. A ValueError, so code written against
    vLLM's checks keeps working. Layers above the engine (HTTP, WebSocket) read
    ``field`` and ``reason`` and, where their request names the field
    differently, build a copy with :meth:`renamed` or :meth:`under`; nothing
    parses the message text.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def renamed(self, field: str) -> ValidationError:
        """The same error (same type, same reason) naming ``field`` instead."""
        if field == self.field:
            return self
        return type(self)(field, self.reason)

    def under(self, parent: str) -> ValidationError:
        """The same error naming ``parent.field`` (``params.temperature``)."""
        return self.renamed(f"{parent}.{self.field}")


class ConstraintFailedError(EngineGenerateError, ValidationError):
    """One request failed because of its own input, found while generating: its output
    constraint (a grammar past the grammar engine's limits, say). Names the field, as a
    ValidationError; the engine is healthy and keeps serving others."""

    def __init__(self, request_id: str, field: str, message: str) -> None:
        LegatoError.__init__(self, f"request {request_id!r}: {field}: {message}")
        self.request_id = request_id
        self.field = field
        self.reason = message

    def renamed(self, field: str) -> ConstraintFailedError:
        """The same failure of the same request, naming ``field`` instead."""
        if field == self.field:
            return self
        return ConstraintFailedError(self.request_id or "", field, self.reason)


class PromptTooLongError(ValidationError):
    """prompt + max_tokens exceed max_model_len."""


class EngineStartupError(LegatoError, RuntimeError):
    """The engine could not start (bad model directory, weights failed to load...)."""


class EngineStartupTimeout(EngineStartupError, TimeoutError):
    """The model worker was not ready within ``engine_ready_timeout`` seconds. A
    TimeoutError, as vLLM's start-up timeout is; the worker is reaped."""


class ModelLoadError(EngineStartupError, ValueError):
    """The model argument names nothing loadable: a missing path, a corrupt or
    truncated GGUF file, an unsupported tensor type, the default model not installed.

    The message is one line that names the file and says what to do.
    """
