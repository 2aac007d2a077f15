"""The output processor: each step's ``EngineCoreOutputs`` become ``RequestOutput``s.

The stage after the scheduler: ``OutputProcessor.process_outputs`` takes one
step's outputs, detokenizes them (``detokenizer``), applies stop strings
(``stop_strings``) and logprobs (``logprobs``), merges n>1 completions and
puts each request's output, in its output kind, into its ``OutputSink``. The
per-request state is in ``output_state``.

Plain synchronous classes: the actor that feeds them is ``Frontend.deliver``.
Never imports trio or torch (the slot type is only named for type checking).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..protocol.errors import ConstraintFailedError, EngineGenerateError
from ..protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from ..protocol.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from ..protocol.params import LoRARequest, RequestOutputKind, SamplingParams
from ..protocol.request_ids import child_id
from .detokenizer import AnyTokenizer, DetokenizationError, TokenTexts, make_detokenizer
from .logprobs import add_logprobs, add_prompt_logprobs
from .output_state import CompletionState, FinishedRequestStats, ProcessedStep, RequestState
from .stop_strings import find_stop_string

if TYPE_CHECKING:
    from .sink import OutputSink

__all__ = ["OutputProcessor", "ProcessedStep"]


class OutputProcessor:
    """Turns each step's ``EngineCoreOutputs`` into ``RequestOutput``s in the requests' slots.

    Per request (caller's id) it keeps n completions, each with its own
    ``IncrementalDetokenizer``, stop-string check and logprobs; for n>1 the
    scheduler runs n children (ids from ``add_request``) whose outputs merge
    under the caller's id. Outputs follow ``params.output_kind``:

    - ``DELTA``: only what is new since the last output, and only the
      completions that have news (new tokens or a finish);
    - ``CUMULATIVE``: the completions that have news, each with everything so far
      (as vLLM streams n>1; the slot folds untaken ones by index, so a consumer that
      reads late still sees every completion's latest);
    - ``FINAL_ONLY``: one output, when every completion has finished.

    ``finished=True`` is on the last output only. While a request has stop
    strings (and ``include_stop_str_in_output`` is off), text that could be
    the start of a stop string is held back until it is known not to be one
    (or the request finishes), so no stop string ever reaches a stream.

    Never blocks: slots merge what their consumers have not taken yet.
    """

    def __init__(self, tokenizer: AnyTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._completions: dict[str, CompletionState] = {}  # by scheduler-level id
        # Single tokens' texts: for logprobs, and whole tokens for the detokenizers.
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        slot: OutputSink,
        child_ids: Sequence[str] | None = None,
        output_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        """Register a request; return the ids the scheduler runs it under.

        ``child_ids`` (n of them, in index order) if given; else
        ``[request_id]`` for n == 1 and ``child_id(i, request_id)``
        for n > 1 (the renderer's naming). ``params`` are
        the caller's (n, stop strings, output kind). ``output_id`` is the id
        the outputs and errors carry (default ``request_id``): the caller's,
        when the engine runs the request under an id of its own. ``lora_request``:
        the adapter it runs through, which its outputs name (as vLLM's). Raises
        ValueError for a live duplicate id, a slot of another output kind, or
        stop strings without a tokenizer.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if slot.output_kind != params.output_kind:
            raise ValueError(
                f"output_kind: the slot merges as {slot.output_kind.name}, "
                f"the request asks for {params.output_kind.name}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        if child_ids is not None:
            ids = list(child_ids)
        elif params.n == 1:
            ids = [request_id]
        else:
            ids = [child_id(i, request_id) for i in range(params.n)]
        if len(ids) != params.n:
            raise ValueError(f"child_ids: expected {params.n} ids, got {len(ids)}")
        if clash := [i for i in ids if i in self._completions]:
            raise ValueError(f"request_id: {clash[0]!r} is already running")
        request = RequestState(
            request_id,
            request_id if output_id is None else output_id,
            prompt,
            list(prompt_token_ids),
            params,
            arrival_time,
            slot,
            lora_request=lora_request,
        )
        for index, completion_id in enumerate(ids):
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = make_detokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    token_texts=self._token_texts,
                )
            completion = CompletionState(completion_id, index, request, detokenizer)
            completion.streams_text = (
                params.output_kind == RequestOutputKind.DELTA and not params.stop
            )
            if (
                completion.streams_text
                and params.n == 1
                and params.logprobs is None
                and params.prompt_logprobs is None
            ):
                completion.shortcut = self._stream_plain
            if params.logprobs is not None:
                completion.cumulative_logprob = 0.0
                if params.output_kind != RequestOutputKind.DELTA:
                    completion.logprobs = []
            request.completions.append(completion)
            self._completions[completion_id] = completion
        self._requests[request_id] = request
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --------------------------------------------------------------- steps

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedStep:
        """Handle one step: detokenize, check stop strings, put outputs into slots.

        Outputs for unknown or already finished ids (e.g. a stop string fired
        before the scheduler's abort took effect) are ignored. A completion
        with ``FinishReason.ERROR``, or whose tokens the tokenizer cannot
        decode (``DetokenizationError``), fails its whole request: the slot
        gets ``EngineGenerateError`` and the siblings are aborted.
        """
        now = outputs.timestamp
        step = ProcessedStep()
        touched: dict[str, RequestState] = {}
        completions = self._completions
        for core in outputs.outputs:
            if core.pooled is not None:  # read by encode() when the request ends
                step.pooled[core.request_id] = core.pooled
            completion = completions.get(core.request_id)
            if completion is None or completion.finish_reason is not None:
                continue
            request = completion.parent
            if core.finish_reason == FinishReason.ERROR:
                message = core.error or "the request failed"
                error = (
                    EngineGenerateError(request.output_id, message)
                    if core.error_field is None
                    else ConstraintFailedError(request.output_id, core.error_field, message)
                )
                self._fail(request, error, now, step, failed_id=core.request_id)
                touched.pop(request.request_id, None)
                continue
            try:
                shortcut = completion.shortcut
                if shortcut is not None and shortcut(completion, core, now, step):
                    continue
                self._update(completion, core, now, step)
            except DetokenizationError as exc:
                self._fail(request, EngineGenerateError(request.output_id, str(exc)), now, step)
                touched.pop(request.request_id, None)
                continue
            if len(request.completions) == 1:
                self._emit(request, now, step)
            else:  # once all of this step's news of its completions is in
                touched[request.request_id] = request
        for request in touched.values():
            self._emit(request, now, step)
        return step

    def _stream_plain(
        self, completion: CompletionState, core: EngineCoreOutput, now: float, step: ProcessedStep
    ) -> bool:
        """The plain completions' shortcut (see ``CompletionState.shortcut``).

        A plain completion's ordinary step (new tokens, after its first; no finish, no
        logprobs): record it and put its output, what ``_update`` and ``_emit`` would, built
        directly. Returns False, having done nothing, for any other step.

        Most of a busy engine's outputs are these, once per stream per step; the test
        ``test_plain_streams_match_the_general_path`` holds the two paths to one result.
        """
        new_ids = core.new_token_ids
        last = completion.last_token_time
        if (
            last is None
            or not new_ids
            or core.finish_reason is not None
            or core.new_logprobs
            or core.new_prompt_logprobs is not None
        ):
            return False
        detokenizer = completion.detokenizer
        text = "" if detokenizer is None else detokenizer.update(new_ids)
        step.inter_token_latency.append(now - last)
        step.num_generation_tokens += len(new_ids)
        completion.last_token_time = now
        completion.token_ids += new_ids
        request = completion.parent
        lora = request.lora_request
        request.slot.put(
            RequestOutput(  # positional: see CompletionState.take_delta
                request.output_id,
                request.prompt,
                request.prompt_token_ids,
                None,
                [CompletionOutput(0, text, list(new_ids), None, None, None, None, lora)],
                False,
                RequestMetrics(request.arrival_time, None, completion.first_token_time, now, None),
                lora,
                None,
                None,
                completion.num_cached_tokens,
            )
        )
        return True

    def _update(
        self, completion: CompletionState, core: EngineCoreOutput, now: float, step: ProcessedStep
    ) -> None:
        """Take one step's news for a completion. Several tokens in one step (speculative
        decoding) under stop strings are taken one at a time, up to the one that completes
        a stop string: the output ends where one token a step would have ended it."""
        new_ids = core.new_token_ids
        if len(new_ids) < 2 or not completion.parent.params.stop or completion.streams_text:
            self._update_one(completion, core, now, step)
            return
        last = len(new_ids) - 1
        logprobs = core.new_logprobs
        for j, token_id in enumerate(new_ids):
            one = EngineCoreOutput(
                core.request_id,
                [token_id],
                logprobs[j : j + 1] if logprobs else None,
                core.new_prompt_logprobs if j == 0 else None,
                core.finish_reason if j == last else None,
                core.stop_reason if j == last else None,
                core.num_cached_tokens,
            )
            self._update_one(completion, one, now, step)
            if completion.finish_reason is not None:
                return

    def _update_one(
        self, completion: CompletionState, core: EngineCoreOutput, now: float, step: ProcessedStep
    ) -> None:
        request = completion.parent
        params = request.params
        new_ids = core.new_token_ids
        if completion.num_cached_tokens is None:
            completion.num_cached_tokens = core.num_cached_tokens
        if new_ids:
            last = completion.last_token_time
            if last is None:
                completion.first_token_time = now
                step.time_to_first_token.append(now - request.arrival_time)
            else:
                step.inter_token_latency.append(now - last)
            completion.last_token_time = now
            step.num_generation_tokens += len(new_ids)
            completion.token_ids += new_ids
            completion.new_token_ids += new_ids
            completion.has_news = True
        if core.new_logprobs:
            add_logprobs(completion, core.new_logprobs, self._token_text)
        if core.new_prompt_logprobs is not None and completion.index == 0:
            add_prompt_logprobs(request, core.new_prompt_logprobs, self._token_text)
        finish_reason, stop_reason = core.finish_reason, core.stop_reason

        detokenizer = completion.detokenizer
        if detokenizer is not None:
            text_ids = new_ids
            if (
                finish_reason == FinishReason.STOP
                and new_ids
                and not params.include_stop_str_in_output
            ):
                text_ids = new_ids[:-1]  # the EOS / stop token's own text is not output
            piece = detokenizer.update(text_ids) if text_ids else ""
            if finish_reason is not None:
                piece += detokenizer.flush()
            if completion.streams_text:
                completion.new_text += piece
            else:
                searched_from = len(completion.text)
                completion.text += piece
                # As for stop token ids, min_tokens tokens come before the one that may stop.
                if params.stop and len(completion.token_ids) > params.min_tokens:
                    match = find_stop_string(completion.text, searched_from, params.stop)
                    if match is not None:
                        stop, start = match
                        end = start + len(stop) if params.include_stop_str_in_output else start
                        completion.text = completion.text[:end]
                        if finish_reason is None:
                            step.requests_to_stop.append(completion.request_id)
                        finish_reason, stop_reason = FinishReason.STOP, stop
        if finish_reason is not None:
            self._finish(completion, finish_reason, stop_reason, now, step)
        if not completion.streams_text:
            completion.release()

    def _finish(
        self,
        completion: CompletionState,
        reason: FinishReason,
        stop_reason: int | str | None,
        now: float,
        step: ProcessedStep,
    ) -> None:
        completion.finish_reason, completion.stop_reason = reason, stop_reason
        completion.has_news = True
        request = completion.parent
        step.finished.append(
            FinishedRequestStats(
                request_id=completion.request_id,
                parent_id=request.request_id,
                finish_reason=reason,
                arrival_time=request.arrival_time,
                first_token_time=completion.first_token_time,
                last_token_time=completion.last_token_time,
                finished_time=now,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_generation_tokens=len(completion.token_ids),
                num_cached_tokens=completion.num_cached_tokens or 0,
            )
        )

    def _emit(self, request: RequestState, now: float, step: ProcessedStep) -> None:
        """Put this step's output for ``request`` into its slot; forget it once finished."""
        every = request.completions
        if len(every) == 1:  # the common case: no generators
            (only,) = every
            finished = only.finish_reason is not None
            news = every if only.has_news else []
        else:
            finished = request.finished
            news = [c for c in every if c.has_news]
        kind = request.params.output_kind
        completions: list[CompletionOutput] = []
        prompt_logprobs: PromptLogprobs | None = None
        # map(), not a comprehension: no function frame per call on Python 3.11.
        if kind == RequestOutputKind.DELTA:
            completions = list(map(CompletionState.take_delta, news))
            if news and not request.prompt_logprobs_sent:
                prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        else:
            if news and kind == RequestOutputKind.CUMULATIVE:
                # As vLLM streams n>1: the completions that advanced, each whole so far
                # (a consumer's slot folds what it has not taken yet, by index).
                completions = list(map(CompletionState.cumulative_output, news))
                prompt_logprobs = request.prompt_logprobs
            elif news and finished:  # FINAL_ONLY: all n at once
                completions = list(map(CompletionState.cumulative_output, every))
                prompt_logprobs = request.prompt_logprobs
            for c in news:
                c.clear_news()
        if completions:
            request.slot.put(
                RequestOutput(  # positional: see CompletionState.take_delta
                    request.output_id,
                    request.prompt,
                    request.prompt_token_ids,
                    None if prompt_logprobs is None else list(prompt_logprobs),
                    completions,
                    finished,
                    request.metrics(now if finished else None),
                    request.lora_request,
                    None,
                    None,
                    request.completions[0].num_cached_tokens,
                )
            )
        if finished:
            self._forget(request)

    def _forget(self, request: RequestState) -> None:
        self._requests.pop(request.request_id, None)
        for c in request.completions:
            self._completions.pop(c.request_id, None)

    def _token_text(self, token_id: int) -> str | None:
        return None if self._token_texts is None else self._token_texts.text(token_id)

    # ------------------------------------------------------ aborts, errors

    def abort_requests(
        self, request_ids: Iterable[str], *, now: float | None = None
    ) -> ProcessedStep:
        """Finish requests (caller's ids) with reason "abort" and forget them.

        Each slot gets a last output (``finished=True``, finish_reason
        "abort", text held back for stop strings released; a character still
        incomplete is dropped). Unknown or finished ids are ignored.
        ``requests_to_abort`` lists the children still live in the scheduler.
        """
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            for c in request.completions:
                if c.finished:
                    continue
                step.requests_to_abort.append(c.request_id)
                self._finish(c, FinishReason.ABORT, None, now, step)
                c.release()
            self._emit(request, now, step)
        return step

    def fail_request(
        self, request_id: str, error: BaseException, *, now: float | None = None
    ) -> ProcessedStep:
        """Fail a request (caller's id): its slot gets ``error``, and it is forgotten.

        Unknown or finished ids are ignored. ``requests_to_abort`` lists the
        children still live in the scheduler.
        """
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        request = self._requests.get(request_id)
        if request is not None:
            self._fail(request, error, now, step)
        return step

    def fail_all(self, error: BaseException, *, now: float | None = None) -> ProcessedStep:
        """Fail every open request with ``error`` (e.g. the engine died) and forget them all."""
        now = time.monotonic() if now is None else now
        step = ProcessedStep()
        for request in list(self._requests.values()):
            self._fail(request, error, now, step)
        return step

    def _fail(
        self,
        request: RequestState,
        error: BaseException,
        now: float,
        step: ProcessedStep,
        *,
        failed_id: str | None = None,
    ) -> None:
        request.slot.put_error(error)
        for c in request.completions:
            if c.finished:
                continue
            if c.request_id != failed_id:
                step.requests_to_abort.append(c.request_id)
            self._finish(c, FinishReason.ERROR, None, now, step)
        self._forget(request)
