"""Runner: what the model worker needs of a model runner.

Two implement it: ``legato.models.runner.ModelRunner`` (the real model on the
paged KV cache) and ``legato.null_runner.NullModelRunner`` (no model,
for control-plane benchmarks). ``legato.workers.worker`` is typed against this
protocol, so ``mypy --strict`` checks both. A runner's further public methods
(LoRA, ``embedding_size``...) are served by name through ``UtilityCall`` where
it has them; the engine never needs them of every runner.

Imports neither torch nor trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .messages import ModelRunnerOutput, SchedulerOutput


class Runner(Protocol):
    """One step at a time: ``execute`` is called in step order, from one thread."""

    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> object:
        """Reported as ``str(dtype)`` without a ``torch.`` prefix."""
        ...

    @property
    def device(self) -> object:
        """Reported as ``str(device)``."""
        ...

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's request deltas, compute its scheduled tokens, sample.
        Blocks; an exception is fatal to the worker."""
        ...

    def execute_model(self, step: SchedulerOutput) -> Any:
        """``execute``'s first half (the deltas and the forward) for a step whose bitmask
        rows come later: what ``sample_tokens`` needs, which must follow before any other
        step. Blocks; an exception is fatal to the worker."""
        ...

    def sample_tokens(self, forward: Any, grammar_bitmask: dict[str, bytes]) -> ModelRunnerOutput:
        """``execute``'s second half: sample ``execute_model``'s step with its bitmask rows."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 2: also the weights) until ``wake_up``."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed (``tags``: None = everything)."""
        ...

    def reset_kv_cache(self) -> None:
        """Forget the contents of every KV block."""
        ...

    def held_requests(self) -> list[str]:
        """Ids of the requests whose state the runner holds."""
        ...
