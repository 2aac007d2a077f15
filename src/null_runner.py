"""The null-model runner: answers every step at once with a fixed token.

Selected with ``runner="null"``. It has the ModelRunner's interface and no
model, so a benchmark through it measures the control plane alone: renderer,
scheduler, executor frames, detokenizer and streams. It is never a stand-in
for a real model anywhere else. Reached through ``legato.workers.runner_registry``; never
imports torch or trio.
"""

from __future__ import annotations

import json
import os

from .config import EngineConfig
from .protocol import messages as m


class NullModelRunner:
    """ModelRunner's interface; ``execute`` samples ``token_id`` for every ready request."""

    def __init__(self, config: EngineConfig, *, token_id: int | None = None) -> None:
        vocab_size = 32000
        if config.model is not None:
            with open(os.path.join(config.model, "config.json")) as f:
                vocab_size = int(json.load(f).get("vocab_size", vocab_size))
        self.vocab_size = vocab_size
        self.num_kv_blocks = config.num_kv_blocks or 65536
        self.max_model_len = config.max_model_len or 4096
        self.eos_token_ids: list[int] = []
        self.dtype = "float32"
        self.device = "cpu"
        # Token id 300 is an ordinary byte-pair in the toy tokenizer; any id works.
        self.token_id = min(300, vocab_size - 1) if token_id is None else token_id
        self._known: dict[str, int] = {}  # request id -> tokens known to the runner

    def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        known = self._known
        for rid in step.finished_req_ids + step.preempted_req_ids:
            known.pop(rid, None)
        computed: dict[str, int] = {}
        for new in step.new_requests:
            known[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.request_id] = new.num_computed_tokens
        cached = step.cached_requests
        for rid, tokens in cached.new_token_ids.items():
            known[rid] = known.get(rid, 0) + len(tokens)
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        num_scheduled = step.num_scheduled_tokens
        req_ids = list(num_scheduled)
        num_sampled = []
        for rid in req_ids:
            if computed.get(rid, 0) + num_scheduled[rid] >= known[rid]:
                known[rid] += 1  # the sample is the request's next token, as in ModelRunner
                num_sampled.append(1)
            else:
                num_sampled.append(0)
        sampled = [self.token_id] * sum(num_sampled)
        return m.ModelRunnerOutput(step.step_id, req_ids, num_sampled, sampled)

    def execute_model(self, step: m.SchedulerOutput) -> m.SchedulerOutput:
        return step  # nothing to compute ahead: ``sample_tokens`` runs the whole step

    def sample_tokens(
        self, step: m.SchedulerOutput, grammar_bitmask: dict[str, bytes]
    ) -> m.ModelRunnerOutput:
        return self.execute(step)  # the null model ignores token bitmasks

    def sleep(self, level: int = 1) -> None:
        return None

    def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    def reset_kv_cache(self) -> None:
        return None

    def held_requests(self) -> list[str]:
        """Ids of the requests whose state the runner holds."""
        return list(self._known)
