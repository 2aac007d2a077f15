"""The runner registry: which ``Runner`` serves ``EngineConfig.runner``.

- ``"model"``: :class:`legato.models.runner.ModelRunner`, a real model on the
  paged KV cache (imports torch);
- ``"null"``: :class:`legato.null_runner.NullModelRunner`, no model at all, for
  the control-plane benchmarks.

Each factory imports its runner when called, so a null-runner worker never
imports torch. The worker side reaches runners only through here. Never imports
trio, and never ``legato.testing``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import EngineConfig
from ..protocol.runner import Runner

RunnerFactory = Callable[[EngineConfig, Any], Runner]
"""Builds a runner from the engine's config and its tensor-parallel group (or None)."""


def _model_runner(config: EngineConfig, parallel: Any) -> Runner:
    from ..models.runner import ModelRunner

    return ModelRunner(config, parallel=parallel)


def _null_runner(config: EngineConfig, parallel: Any) -> Runner:
    from ..null_runner import NullModelRunner

    return NullModelRunner(config)


RUNNERS: dict[str, RunnerFactory] = {"model": _model_runner, "null": _null_runner}


def build_runner(config: EngineConfig, parallel: Any = None) -> Runner:
    """The runner ``config.runner`` names; ValueError naming the field if none is registered."""
    factory = RUNNERS.get(config.runner)
    if factory is None:
        raise ValueError(f"runner: unknown runner {config.runner!r} (known: {sorted(RUNNERS)})")
    return factory(config, parallel)
