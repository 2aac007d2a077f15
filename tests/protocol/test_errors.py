"""The public errors sit on vLLM's base classes, so vLLM's ``except`` clauses catch them."""

from __future__ import annotations

import pytest

from legato.protocol.errors import (
    ConstraintFailedError,
    EngineDeadError,
    EngineGenerateError,
    EngineStartupError,
    ModelLoadError,
    PromptTooLongError,
    ValidationError,
)


def test_engine_dead_error_is_a_runtime_error_built_without_arguments() -> None:
    # vLLM's multiprocess client raises MQEngineDeadError(RuntimeError) and
    # LaunchEngineClient.dead_error is a RuntimeError: `except RuntimeError` must hold.
    with pytest.raises(RuntimeError):
        raise EngineDeadError()
    hidden = EngineDeadError(suppress_context=True)
    assert hidden.__suppress_context__ and "dead" in str(hidden)


def test_generate_error_is_built_without_arguments_as_vllms() -> None:
    error = EngineGenerateError()
    assert error.request_id is None and str(error) == "the request failed"
    named = EngineGenerateError("r1", "boom")
    assert named.request_id == "r1" and str(named) == "request 'r1': boom"
    failed = ConstraintFailedError("r2", "structured_outputs.grammar", "too deep")
    assert isinstance(failed, EngineGenerateError) and isinstance(failed, ValueError)


def test_input_errors_are_value_errors_and_startup_errors_runtime_errors() -> None:
    assert issubclass(ValidationError, ValueError)
    assert issubclass(PromptTooLongError, ValueError)
    # vLLM: RuntimeError("Engine core initialization failed...").
    assert issubclass(EngineStartupError, RuntimeError)
    assert issubclass(ModelLoadError, RuntimeError) and issubclass(ModelLoadError, ValueError)


def test_a_constraint_failure_renamed_for_a_frame_keeps_its_request_and_reason() -> None:
    """The WebSocket names fields under ``params``: renaming a ConstraintFailedError must
    work (it once raised AttributeError there and the connection died with 1011)."""
    failed = ConstraintFailedError("r2", "structured_outputs.regex", "token 0 fails parse")
    framed = failed.under("params")
    assert isinstance(framed, ConstraintFailedError)
    assert framed.field == "params.structured_outputs.regex"
    assert framed.reason == "token 0 fails parse"
    assert framed.request_id == "r2"
    assert failed.renamed(failed.field) is failed
