"""The step token budget: chosen for the worker's device when not given.

On a CPU a step's time grows with its tokens, so the default budget there is
smaller (``STEP_TOKENS_CPU``): a burst of prompts is prefilled in smaller
steps, each holding the running decodes for less time. Driven through the real
engine wiring (``build_engine_parts``) and the real Scheduler; no timing.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from legato.config import STEP_TOKENS, STEP_TOKENS_CPU
from legato.engine_parts import build_engine_parts
from legato.protocol.messages import WorkerReady

from .harness import make_config, make_request

PROMPT = 256


def _first_step_admits(device: str, tokenizer: PreTrainedTokenizerBase, **kwargs: int) -> int:
    """Prompts the first step of a burst of 8 starts, on a worker on ``device``."""
    ready = WorkerReady(1, 300, 1024, 32000, [2], "float32", device)
    parts = build_engine_parts(make_config(max_model_len=1024, **kwargs), ready, tokenizer)
    for i in range(8):
        parts.scheduler.add_request(make_request(f"r{i}", PROMPT, max_tokens=4))
    plan = parts.scheduler.schedule()
    assert plan.total_num_scheduled_tokens == len(plan.new_requests) * PROMPT
    return len(plan.new_requests)


@pytest.mark.parametrize(("device", "budget"), [("cpu", STEP_TOKENS_CPU), ("cuda:0", STEP_TOKENS)])
def test_the_default_budget_follows_the_workers_device(
    device: str, budget: int, toy_tokenizer: PreTrainedTokenizerBase
) -> None:
    assert STEP_TOKENS_CPU < STEP_TOKENS
    assert _first_step_admits(device, toy_tokenizer) == budget // PROMPT


def test_a_given_budget_is_kept_on_a_cpu(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    assert _first_step_admits("cpu", toy_tokenizer, max_num_batched_tokens=2048) == 8
    assert _first_step_admits("cpu", toy_tokenizer, max_num_batched_tokens=512) == 2


def test_the_budget_is_left_open_until_the_device_is_known() -> None:
    config = make_config()
    assert config.max_num_batched_tokens is None
    assert config.token_budget("cpu") == STEP_TOKENS_CPU
    assert config.token_budget() == STEP_TOKENS
    resolved = config.resolved(max_model_len=256, num_kv_blocks=64, device="cpu")
    assert resolved.max_num_batched_tokens == STEP_TOKENS_CPU
