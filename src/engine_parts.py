"""One wiring of the engine's synchronous parts, for every driver.

``build_engine_parts`` takes the config, what the worker reported when it was
ready (``WorkerReady``) and the tokenizer, and builds what both ``AsyncEngine``
and ``LLMEngine`` run on: the resolved config (``max_model_len`` within the KV
cache), the renderer with its grammars, the scheduler and the output
processor. Blocks for a moment (the grammar compiler is built lazily, later).

Never imports trio or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .frontend.renderer import Renderer
from .outputs.output_processor import OutputProcessor
from .protocol import messages as m
from .scheduling.scheduler import Scheduler
from .structured.engine import EngineGrammars


@dataclass(frozen=True)
class EngineParts:
    """The synchronous parts of one engine, wired together."""

    config: EngineConfig  # resolved: max_model_len and num_kv_blocks set
    renderer: Renderer
    grammars: EngineGrammars
    scheduler: Scheduler
    processor: OutputProcessor


def build_engine_parts(config: EngineConfig, ready: m.WorkerReady, tokenizer: Any) -> EngineParts:
    """The parts for a worker that reported ``ready``; see the module docstring."""
    # Block 0 is the scheduler's null block: a request can use the others.
    max_len = min(ready.max_model_len, (ready.num_kv_blocks - 1) * config.block_size)
    config = config.resolved(
        max_model_len=max_len, num_kv_blocks=ready.num_kv_blocks, device=ready.device
    )
    grammars = EngineGrammars(tokenizer, ready.vocab_size, ready.eos_token_ids)
    renderer = Renderer(
        tokenizer,
        max_model_len=max_len,
        vocab_size=ready.vocab_size,
        eos_token_ids=ready.eos_token_ids,
        max_logprobs=config.max_logprobs,
        grammars=grammars,
    )
    scheduler = Scheduler(config, kv_sliding_window=ready.kv_sliding_window)
    return EngineParts(config, renderer, grammars, scheduler, OutputProcessor(tokenizer))
