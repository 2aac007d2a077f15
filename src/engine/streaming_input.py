"""``StreamingSession``: vLLM's streaming-input sessions (``generate`` given an async
generator of ``StreamingInput`` chunks) over ordinary requests.

As vLLM's: each chunk runs as a request of its own, in order, as the chunks arrive; its
prompt is the whole session so far (every chunk's tokens, and the tokens generated for
the earlier chunks, each request's last sampled token left out), and every generated
token reaches the session's one stream. A chunk's ``sampling_params`` apply to its
request (else the session's). The last output (``finished=True``) comes once the input
generator is exhausted; an abort of the session's id ends it at once.

Where legato differs: a chunk after the first is tokenized without special tokens (no
second BOS in the middle of the session); n must be 1.

Never imports models, the worker side or torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any

from ..protocol.client import StreamingInput
from ..protocol.errors import ValidationError
from ..protocol.outputs import CompletionOutput, RequestOutput
from ..protocol.params import RequestOutputKind, SamplingParams
from .request_stream import RequestStream, StreamRequest


class StreamingSession(RequestStream):
    """The session's outputs, used as any ``RequestStream`` (async iterator and async
    context manager; ``aclose`` or leaving the ``async with`` aborts the running chunk
    and closes the input generator)."""

    def __init__(
        self,
        engine: Any,  # the AsyncEngine (its renderer and generate); not imported: no cycle
        inputs: AsyncIterable[StreamingInput],
        params: SamplingParams,
        request_id: str,
        options: dict[str, Any],
    ) -> None:
        super().__init__(engine, StreamRequest(prompt=[], params=params), request_id)
        if params.n != 1:
            raise ValidationError("n", "a streaming-input session runs one completion (n=1)")
        self._outputs = _session(engine, inputs.__aiter__(), params, request_id, options)

    async def __aenter__(self) -> StreamingSession:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            return await self._outputs.__anext__()
        except BaseException:
            self._done = True
            await self._outputs.aclose()
            raise

    async def aclose(self) -> None:
        self._done = True
        await self._outputs.aclose()


async def _next(inputs: AsyncIterator[StreamingInput]) -> StreamingInput | None:
    try:
        chunk = await inputs.__anext__()
    except StopAsyncIteration:
        return None
    if not isinstance(chunk, StreamingInput):
        raise ValidationError("prompt", f"a streaming input yields StreamingInput, got {chunk!r}")
    return chunk


async def _session(
    engine: Any,
    inputs: AsyncIterator[StreamingInput],
    params: SamplingParams,
    request_id: str,
    options: dict[str, Any],
) -> AsyncGenerator[RequestOutput, None]:
    kind = params.output_kind
    context: list[int] = []
    tokens: list[int] = []
    text = ""
    last: CompletionOutput | None = None
    try:
        chunk = await _next(inputs)
        if chunk is None:
            raise ValidationError("prompt", "the streaming input yielded no chunk")
        while chunk is not None:
            own = chunk.sampling_params or params
            if not isinstance(own, SamplingParams) or own.n != 1:
                raise ValidationError("sampling_params", "each chunk's must be SamplingParams, n=1")
            kwargs = {"add_special_tokens": False} if context else None
            ids = engine.renderer.render_prompt(chunk.prompt, tokenization_kwargs=kwargs).token_ids
            prompt_ids = context + ids
            new: list[int] = []
            sub = own.clone(output_kind=RequestOutputKind.DELTA)
            async with engine.generate(
                {"prompt_token_ids": prompt_ids}, sub, request_id, **options
            ) as stream:
                async for out in stream:
                    last = out.outputs[0]
                    new += last.token_ids
                    tokens += last.token_ids
                    text += last.text
                    if kind != RequestOutputKind.FINAL_ONLY and (last.token_ids or last.text):
                        yield _shaped(out, last, kind, tokens, text, finished=False)
            if last is not None and last.finish_reason == "abort":
                break  # the session's id was aborted: the session ends here
            context = prompt_ids + new[:-1]
            chunk = await _next(inputs)
        assert last is not None
        end = RequestOutput(request_id, None, context or None, None, [last], True)
        yield _shaped(end, last, kind, tokens, text, finished=True)
    finally:
        aclose = getattr(inputs, "aclose", None)
        if aclose is not None:
            await aclose()


def _shaped(
    out: RequestOutput,
    last: CompletionOutput,
    kind: RequestOutputKind,
    tokens: list[int],
    text: str,
    *,
    finished: bool,
) -> RequestOutput:
    """One session output: this step's news (DELTA; none on the closing output) or the
    whole session so far (CUMULATIVE, FINAL_ONLY); the finish only on the last."""
    finish = last.finish_reason if finished else None
    stop = last.stop_reason if finished else None
    if kind == RequestOutputKind.DELTA:
        ids, piece = ([], "") if finished else (list(last.token_ids), last.text)
        completion = CompletionOutput(0, piece, ids, last.cumulative_logprob, None, finish, stop)
    else:
        completion = CompletionOutput(
            0, text, list(tokens), last.cumulative_logprob, None, finish, stop
        )
    return RequestOutput(
        out.request_id,
        out.prompt,
        out.prompt_token_ids,
        None,
        [completion],
        finished,
        out.metrics,
        out.lora_request,
    )
