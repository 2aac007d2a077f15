"""The engine's side of structured outputs (main process): compile at admission, one bitmask
row per constrained request each step, advance the grammars over the sampled tokens.

:class:`EngineGrammars` is made once per engine and used by two actors:

- the renderer calls :meth:`EngineGrammars.compile` (blocking: run it in a thread) for each
  request whose params carry ``structured_outputs``; a constraint that does not compile
  raises ``ValidationError`` naming the request's field, and only that request fails. The
  grammar-engine tokenizer is built on the first such request (about 0.5 s for a 49k
  vocabulary), so engines that never see one never pay for it;
- the scheduler loop calls :meth:`EngineGrammars.bitmasks` for each step that
  :meth:`EngineGrammars.constrains`, once every earlier step is applied (the rows travel
  to the worker in ``SchedulerOutput.grammar_bitmask``, or in a ``GrammarBitmask`` frame
  while the step's forward runs; the sampler applies them before anything else) and
  :meth:`EngineGrammars.accept` after it. Both return ``{request id: GrammarFailure}``
  for requests whose grammar failed; the loop fails those requests alone
  (``Scheduler.fail``, the error naming the constraint's field), the engine keeps serving.

A request's grammar state is made by :meth:`EngineGrammars.compile`, travels beside the
request to the scheduler, lives on its scheduler ``Request`` (``Request.grammar``) and dies
with it, however the request ends (stop, length, stop string, abort, error). Preemption needs
nothing: a preempted request recomputes tokens its grammar has already accepted, and samples
(and advances the grammar) only past them. n > 1 children each get their own state.

Never imports torch or trio.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..protocol.messages import EngineCoreOutput, EngineRequest, SchedulerOutput
from .grammar import GrammarCompiler, GrammarError, GrammarState, TokenizerInfo, allocate_bitmask


class GrammarFailure(NamedTuple):
    """Why a request's grammar failed while generating: the constraint's field, the message."""

    field: str
    message: str


class EngineGrammars:
    """Structured outputs for one engine: the compiler (built lazily) and the per-step hooks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler; built on first use (blocking, ~0.5 s)."""
        with self._lock:
            if self._compiler is None:
                info = TokenizerInfo.from_hf(self._tokenizer, self.vocab_size, self.eos_token_ids)
                self._compiler = GrammarCompiler(info)
            return self._compiler

    def compile(self, requests: Sequence[EngineRequest]) -> dict[str, GrammarState]:
        """Each constrained request's own grammar state, by request id (empty when the
        requests ask for no structured outputs). Blocking. The states travel beside the
        requests to the scheduler (``AddRequests.grammars``), never inside them.

        Raises ValidationError naming the constraint's field when it does not compile.
        """
        params = requests[0].sampling_params.structured_outputs if requests else None
        if params is None:
            return {}
        compiler = self.compiler
        return {request.request_id: compiler.compile(params) for request in requests}

    def constrains(self, plan: SchedulerOutput, requests: Mapping[str, Any]) -> bool:
        """Whether ``plan`` schedules a request with a grammar (so it needs ``bitmasks``)."""
        return any(
            getattr(requests.get(request_id), "grammar", None) is not None
            for request_id in plan.num_scheduled_tokens
        )

    def bitmasks(
        self, plan: SchedulerOutput, requests: Mapping[str, Any]
    ) -> tuple[dict[str, bytes], dict[str, GrammarFailure]]:
        """This step's bitmask rows by request id, and the requests whose grammar failed.

        ``requests`` maps ids to scheduler ``Request`` objects (``.grammar``). A
        partial prefill chunk gets a row too (the runner ignores rows of requests that
        do not sample this step; computing one does not advance the grammar). A request
        verifying ``k`` drafts (speculative decoding) gets ``k + 1`` rows, one after the
        other in its bytes (:meth:`draft_rows`).
        """
        constrained: list[tuple[str, GrammarState]] = []
        rows: dict[str, bytes] = {}
        failed: dict[str, GrammarFailure] = {}
        drafts_of = plan.scheduled_spec_decode_tokens
        for request_id in plan.num_scheduled_tokens:
            req = requests.get(request_id)
            grammar = getattr(req, "grammar", None)
            if grammar is None:
                continue
            drafts = drafts_of.get(request_id)
            if not drafts:
                constrained.append((request_id, grammar))
                continue
            try:
                rows[request_id] = self.draft_rows(grammar, drafts)
            except GrammarError as exc:
                failed[request_id] = GrammarFailure(grammar.field, _message(str(exc)))
        if not constrained:
            return rows, failed
        compiler = self.compiler
        bitmask = allocate_bitmask(len(constrained), compiler.vocab_size)
        failed_rows = compiler.fill_bitmasks(
            [(grammar, row) for row, (_, grammar) in enumerate(constrained)], bitmask
        )
        for row, (request_id, _) in enumerate(constrained):
            if row not in failed_rows:
                rows[request_id] = bitmask[row].tobytes()
        for row, text in failed_rows.items():
            request_id, grammar = constrained[row]
            failed[request_id] = GrammarFailure(grammar.field, _message(text))
        return rows, failed

    def draft_rows(self, grammar: GrammarState, drafts: Sequence[int]) -> bytes:
        """A drafted request's rows, one per verified position: row ``j`` is the mask after
        the drafts before it, so a draft the grammar refuses is rejected at its position
        and the token chosen there obeys the grammar. The state walks over the drafts it
        accepts and rolls back, so it stays where it was (GrammarError if it fails)."""
        bitmask = allocate_bitmask(len(drafts) + 1, self.compiler.vocab_size)
        valid = grammar.validate(drafts)  # rows past the first refused draft are never used
        before = grammar.num_accepted  # (EOS after a complete grammar is not consumed)
        try:
            for j in range(len(drafts) + 1):
                if j > valid:
                    bitmask[j] = bitmask[valid]
                    continue
                grammar.fill_bitmask(bitmask[j])
                if j < valid:
                    grammar.accept(drafts[j : j + 1])
        finally:
            if grammar.error is None:
                grammar.rollback(grammar.num_accepted - before)
        return bitmask.tobytes()

    def accept(
        self, outputs: Sequence[EngineCoreOutput], requests: Mapping[str, Any]
    ) -> dict[str, GrammarFailure]:
        """Advance each live constrained request over its new tokens; ``{id: failure}`` of
        those whose grammar refused them (or failed). Finished requests are skipped."""
        failed: dict[str, GrammarFailure] = {}
        for out in outputs:
            if not out.new_token_ids or out.finish_reason is not None:
                continue
            req = requests.get(out.request_id)
            grammar = getattr(req, "grammar", None)
            if grammar is None:
                continue
            try:
                grammar.accept(out.new_token_ids)
            except GrammarError as exc:
                failed[out.request_id] = GrammarFailure(grammar.field, _message(str(exc)))
        return failed


def _message(text: str) -> str:
    return f"structured outputs: the grammar failed while generating: {text}"
