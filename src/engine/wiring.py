"""What an engine is built from: the resolved model and the executor ``config`` asks for.

Both block or start nothing: ``open_engine`` and ``AsyncEngine`` call them. Never
imports the worker side or torch at import time (the tensor-parallel executor,
which reaches the rank worker, is imported only when asked for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..actors.executor import Executor, OnFailure
from ..actors.inproc_executor import InprocExecutor
from ..actors.process_executor import ProcessExecutor
from ..config import EngineConfig


def resolve_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model`` resolved to a path and ``served_model_name`` filled in
    (see legato.model_source). Blocks; raises ModelLoadError for a bad model argument."""
    from ..model_source import resolve_model_source

    source = resolve_model_source(config.model)
    return dataclasses.replace(
        config, model=source.path, served_model_name=config.served_model_name or source.name
    )


def make_executor(
    config: EngineConfig, *, on_failure: OnFailure, inject_fault: dict[str, Any] | None = None
) -> Executor:
    """The executor ``config`` asks for: tensor-parallel, in-process or a child process."""
    if config.tensor_parallel_size > 1:
        # Imported here: it reaches the rank worker's module, which `python -m
        # legato.workers.worker` must not find imported already by `import legato`.
        from ..actors.tensor_parallel_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, on_failure=on_failure, inject_fault=inject_fault)
    if config.executor == "inproc":
        return InprocExecutor(config, on_failure=on_failure, inject_fault=inject_fault)
    return ProcessExecutor(config, on_failure=on_failure, inject_fault=inject_fault)
