"""The step token budget: chosen for the worker's device when not given.

On a CPU a step's time grows with its tokens, so a server's default budget there
is smaller (``STEP_TOKENS_CPU``): a burst of prompts is prefilled in smaller
steps, each holding the running decodes for less time. An offline ``LLM`` has no
first token to protect and takes ``STEP_TOKENS`` (``budget_for="throughput"``).
Driven through the real engine wiring (``build_engine_parts``), the real
Scheduler and a real ``LLM``; no timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from legato import LLM
from legato.config import STEP_TOKENS, STEP_TOKENS_CPU, EngineConfig
from legato.engine_parts import build_engine_parts
from legato.protocol.messages import WorkerReady

from .harness import make_config, make_request

PROMPT = 256


def _first_step_admits(device: str, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> int:
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


def test_a_throughput_budget_takes_the_larger_step_on_a_cpu(
    toy_tokenizer: PreTrainedTokenizerBase,
) -> None:
    assert _first_step_admits("cpu", toy_tokenizer, budget_for="throughput") == 8
    assert _first_step_admits("cuda:0", toy_tokenizer, budget_for="throughput") == 8
    given = {"budget_for": "throughput", "max_num_batched_tokens": 512}
    assert _first_step_admits("cpu", toy_tokenizer, **given) == 2


def test_an_unknown_budget_purpose_names_the_field() -> None:
    with pytest.raises(ValueError, match="budget_for"):
        EngineConfig(budget_for="speed")  # type: ignore[arg-type]


def test_the_offline_llm_steps_for_throughput(toy_model_dir: Path) -> None:
    """The engine under a real LLM (its worker on this machine's device) resolved the
    larger budget; a budget the caller gives is kept."""
    args = {"max_model_len": 128, "num_kv_blocks": 64, "disable_log_stats": True}
    with LLM(str(toy_model_dir), **args) as llm:
        assert llm.engine.config.budget_for == "throughput"
        assert llm.engine.config.max_num_batched_tokens == STEP_TOKENS
    with LLM(str(toy_model_dir), max_num_batched_tokens=512, **args) as llm:
        assert llm.engine.config.max_num_batched_tokens == 512
