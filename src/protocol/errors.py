"""The public errors. Never imports torch or trio."""

from __future__ import annotations


class LegatoError(Exception):
    """Base of every error legato raises on purpose."""


class EngineDeadError(LegatoError):
    """The engine has died and cannot serve again.

    Raised by every open stream, every new call and ``check_health`` once the
    engine is dead. ``__cause__`` is the first failure that killed it.
    """

    def __init__(self, message: str = "the engine is dead; see __cause__ for why") -> None:
        super().__init__(message)


class EngineGenerateError(LegatoError):
    """One request failed; the engine is healthy and keeps serving others."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id


class ValidationError(LegatoError, ValueError):
    """Bad input from a caller; names the offending field.

    A ValueError, so code written against vLLM's checks keeps working.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLongError(ValidationError):
    """prompt + max_tokens exceed max_model_len."""


class EngineStartupError(LegatoError):
    """The engine could not start (bad model directory, weights failed to load...)."""


class ModelLoadError(EngineStartupError, ValueError):
    """The model argument names nothing loadable: a missing path, a corrupt or
    truncated GGUF file, an unsupported tensor type, the default model not installed.

    The message is one line that names the file and says what to do.
    """
