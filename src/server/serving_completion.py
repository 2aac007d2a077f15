"""``POST /v1/completions``: prompts (text or token ids) in, ``text_completion`` objects out.

One engine request per prompt, ``n`` choices each; a choice's index in the answer
is ``prompt_index * n + index``. ``echo`` puts the prompt before each choice's text
(in a stream: before its first chunk); ``logprobs`` is the legacy completions object
with text offsets counted from the choice's start (the echoed prompt included).

Imports trio; never torch.
"""

from __future__ import annotations

from typing import Any

from ..protocol.outputs import CompletionOutput
from . import openai_protocol as protocol
from . import openai_schemas as schemas
from .asgi import Request
from .chat_outputs import output_constraint
from .lora_routes import select_model
from .openai_protocol import parse_request
from .serving_base import Job, SSEEvent, StreamingGeneration, decoder, new_id
from .state import ServingState


class CompletionServing(StreamingGeneration):
    """A completions request."""

    def __init__(
        self,
        state: ServingState,
        request: Request,
        parsed: protocol.CompletionRequest,
        **kwargs: Any,
    ) -> None:
        super().__init__(state, request, **kwargs)
        self.parsed = parsed
        self.decode = decoder(state)

    def _logprobs(self, token_ids: list[int], entries: Any, offset: int) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        return schemas.completion_logprobs(token_ids, list(entries or ()), self.decode, offset)

    def _object(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None
    ) -> dict[str, Any]:
        # OpenAI's streamed completions are "text_completion" objects too.
        return schemas.openai_object(
            "text_completion",
            self.request_id,
            self.created,
            self.model,
            choices,
            usage,
            include_usage=usage is not None or self.parsed.include_usage or not self.stream,
        )

    def _usage(self, jobs: list[Job]) -> dict[str, int]:
        return schemas.usage(*self.token_counts(jobs))

    async def prepare(self, jobs: list[Job]) -> None:
        """The prompts' texts, for ``echo`` (token-id prompts decoded off the loop if long)."""
        if not self.parsed.echo:
            return
        for job in jobs:
            if job.first.prompt is not None:
                job.prompt_text = job.first.prompt
            else:
                job.prompt_text = await self.state.engine.detokenize(
                    list(job.first.prompt_token_ids or ()), skip_special_tokens=False
                )

    def delta_events(self, job: Job, delta: CompletionOutput) -> list[SSEEvent]:
        parsed = self.parsed
        echo = ""  # the prompt leads each choice's first chunk
        if parsed.echo and delta.index not in job.echoed:
            job.echoed.add(delta.index)
            echo = job.prompt_text
        if not (
            echo
            or delta.text
            or delta.finish_reason
            or (delta.token_ids and parsed.logprobs is not None)
        ):
            return []  # a token that is not text yet (part of a UTF-8 character)
        offset = job.text_offsets.get(delta.index, len(job.prompt_text))
        logprobs = self._logprobs(delta.token_ids, delta.logprobs, offset)
        if logprobs is not None:
            job.text_offsets[delta.index] = offset + sum(len(t) for t in logprobs["tokens"])
        choice = schemas.completion_choice(
            job.prompt_index * self.params.n + delta.index,
            echo + delta.text,
            logprobs,
            delta.finish_reason,
            delta.stop_reason,
        )
        return [(None, self._object([choice], None))]

    def end_events(self, jobs: list[Job]) -> list[SSEEvent]:
        if not self.parsed.include_usage:
            return []
        return [(None, self._object([], self._usage(jobs)))]

    def response(self, jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for job in jobs:
            echo = job.prompt_text if self.parsed.echo else ""
            for index in sorted(job.choices):
                choice = job.choices[index]
                logprobs = self._logprobs(choice.token_ids, choice.logprobs, len(echo))
                choices.append(
                    schemas.completion_choice(
                        job.prompt_index * self.params.n + index,
                        echo + choice.text,
                        logprobs,
                        choice.finish_reason,
                        choice.stop_reason,
                    )
                )
        return self._object(choices, self._usage(jobs))


async def create_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/completions``."""
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    typed: protocol.CompletionRequest = parse_request(protocol.CompletionRequest, body)
    params = typed.to_sampling_params(
        max_n=state.settings.max_n, structured_outputs=output_constraint(typed)
    )
    lora = select_model(state, typed.model)
    serving = CompletionServing(
        state,
        request,
        typed,
        request_id=new_id("cmpl"),
        model=lora.lora_name if lora is not None else state.model_name,
        prompts=typed.prompts(),
        params=params,
        priority=typed.priority or 0,
        stream=bool(typed.stream),
        renames=typed.renames(),
        lora_request=lora,
    )
    await serving.run()
