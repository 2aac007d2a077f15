"""The OpenAI-compatible endpoints and their companions (/tokenize, /health, /metrics ...).

Each handler takes the ``Request`` and the ``ServingState`` and answers
through the ``asgi`` helpers. Handlers raise ``HTTPError``,
``ValidationError``, ``Unavailable`` or ``EngineDeadError`` for a response
that has not started yet; the router in ``legato.server.http`` turns them
into OpenAI error bodies.

Generation contract, for both completions and chat:

- The request's engine streams are entered and their first outputs awaited
  *before* any response is sent, so a prompt the engine rejects (too long,
  token ids outside the vocabulary) is a 400 even with ``stream: true``.
- A client that disconnects (``http.disconnect``) cancels the work: leaving
  the streams aborts the engine requests and frees their KV blocks.
- Once an SSE response has started, a failure (the engine dying) is sent as
  one ``data: {"error": {...}}`` event followed by ``data: [DONE]``.
- finish_reason is the engine's: "stop", "length", or "abort" (aborted by
  the server, e.g. past the shutdown grace period).

Imports trio; never torch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..engine import RequestStream
from ..frontend.renderer import template_kwargs_of
from ..protocol.errors import EngineDeadError, ValidationError
from ..protocol.outputs import CompletionOutput, Logprob, RequestOutput
from ..protocol.params import LoRARequest, SamplingParams
from . import openai_protocol as protocol
from . import openai_schemas as schemas
from .asgi import HTTPError, Receive, Request, SSEResponse, send_body, send_json, watch_disconnect
from .chat_outputs import ChoiceReader, output_constraint
from .chat_template_sandbox import render_request_template
from .lora_routes import adapter_cards, select_model
from .openai_protocol import parse_request
from .state import LiveRequest, ServingState, Unavailable
from .tool_choice import plan_tools

logger = logging.getLogger("legato.server")

T = TypeVar("T")


# ------------------------------------------------------------------ helpers


class _Disconnected(Exception):
    """The client went away while its request was being served."""


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` while watching ``receive`` for the client's disconnect.

    On a disconnect ``work`` is cancelled and ``_Disconnected`` is raised.
    Exceptions from ``work`` propagate unwrapped.
    """
    result: list[T] = []
    error: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:
            error.append(exc)
        nursery.cancel_scope.cancel()
    if error:
        raise error[0]
    if not result:
        raise _Disconnected()
    return result[0]


def check_model(state: ServingState, model: str | None) -> None:
    """404 ``model_not_found`` unless ``model`` is None or a name this server serves
    (the model's, or a LoRA adapter's)."""
    select_model(state, model)


def error_event(exc: BaseException) -> dict[str, Any]:
    """The body of the SSE error event sent when a started stream fails."""
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, f"the engine is dead: {exc}", code="engine_dead").body()
    if isinstance(exc, ValidationError):  # the request's own input, found while generating
        return HTTPError(400, str(exc), param=exc.field, code="invalid_value").body()
    logger.error("a stream failed", exc_info=exc)  # the detail stays in the server log
    return HTTPError(500, f"internal error: {type(exc).__name__}", code="internal_error").body()


@dataclass
class Job:
    """One engine request of an HTTP request (one prompt; ``n`` choices)."""

    prompt_index: int
    stream: RequestStream
    first: RequestOutput
    prompt_text: str = ""
    choices: dict[int, schemas.ChoiceState] = field(default_factory=dict)
    text_offsets: dict[int, int] = field(default_factory=dict)
    echoed: set[int] = field(default_factory=set)

    @property
    def prompt_tokens(self) -> int:
        return len(self.first.prompt_token_ids or ())


async def open_jobs(
    state: ServingState,
    stack: AsyncExitStack,
    prompts: list[Any],
    params: SamplingParams,
    live: LiveRequest,
    priority: int,
    renames: Mapping[str, str],
    lora_request: LoRARequest | None = None,
) -> list[Job]:
    """Submit one engine request per prompt and wait for each one's first output.

    The streams live in ``stack`` (leaving it aborts unfinished ones).
    Raises the engine's ValidationError (renamed) or EngineDeadError.
    """
    streams = []
    for engine_id, prompt in zip(live.engine_ids, prompts):
        stream = state.engine.generate(
            prompt, params, engine_id, priority=priority, lora_request=lora_request
        )
        streams.append(await stack.enter_async_context(stream))
    jobs = []
    for index, stream in enumerate(streams):
        try:
            first = await stream.__anext__()
        except ValidationError as exc:
            raise schemas.in_request_terms(exc, renames) from None
        jobs.append(Job(index, stream, first))
    return jobs


def decoder(state: ServingState) -> schemas.DecodeToken:
    """Token id (+ its Logprob) -> text, preferring the engine's decoded token."""
    renderer = state.engine.renderer

    def decode(token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return renderer.decode([token_id], skip_special_tokens=False)

    return decode


async def _drain(job: Job, on_output: Callable[[Job, RequestOutput], Awaitable[None]]) -> None:
    """Feed the job's outputs (its first one included) to ``on_output`` until it finishes."""
    await on_output(job, job.first)
    if job.first.finished:
        return
    async for output in job.stream:
        await on_output(job, output)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _engine_ids(request_id: str, count: int) -> list[str]:
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def _outcome(jobs: list[Job]) -> str:
    reasons = {c.finish_reason or "?" for job in jobs for c in job.choices.values()}
    return ",".join(sorted(reasons)) or "?"


# ------------------------------------------------------------------ the generic run


@dataclass
class Generation:
    """What the completions and chat handlers share about one request."""

    state: ServingState
    request: Request
    request_id: str
    model: str
    prompts: list[Any]
    params: SamplingParams
    priority: int
    stream: bool
    include_usage: bool
    renames: Mapping[str, str]  # engine field -> the request's (openai_schemas.request_fields)
    on_start: Callable[[SSEResponse, list[Job]], Awaitable[None]]
    on_delta: Callable[[Job, CompletionOutput], dict[str, Any] | None]
    make_chunk: Callable[[list[dict[str, Any]], dict[str, int] | None], dict[str, Any]]
    make_response: Callable[[list[Job], dict[str, int]], dict[str, Any]]
    lora_request: LoRARequest | None = None  # the adapter the request's model names
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    outcome: str = ""  # for the log line: finish reasons, or what went wrong

    async def run(self) -> None:
        """Serve the request; the response is complete (or the client gone) on return."""
        state = self.state
        jobs: list[Job] = []
        try:
            with state.track(
                self.request_id,
                _engine_ids(self.request_id, len(self.prompts)),
                n=self.params.n,
            ) as live:
                async with AsyncExitStack() as stack:

                    async def start() -> list[Job]:
                        return await open_jobs(
                            state,
                            stack,
                            self.prompts,
                            self.params,
                            live,
                            self.priority,
                            self.renames,
                            self.lora_request,
                        )

                    jobs = await until_disconnect(self.request.receive, start)
                    respond = self._stream if self.stream else self._collect
                    await until_disconnect(self.request.receive, lambda: respond(jobs))
            if live.scope.cancelled_caught:
                self.outcome = self.outcome or "cancelled by shutdown"
        except _Disconnected:
            # A client that leaves right after the last byte is not an interruption.
            self.outcome = self.outcome or "client disconnected"
        except Exception as exc:
            self.outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            completion_tokens = sum(len(c.token_ids) for job in jobs for c in job.choices.values())
            state.log_request(
                self.request_id,
                prompt_tokens=sum(job.prompt_tokens for job in jobs),
                completion_tokens=completion_tokens,
                started=self.started,
                outcome=self.outcome or "?",
            )

    def _usage(self, jobs: list[Job]) -> dict[str, int]:
        completion = sum(len(c.token_ids) for job in jobs for c in job.choices.values())
        return schemas.usage(sum(job.prompt_tokens for job in jobs), completion)

    def _accumulate(self, job: Job, output: RequestOutput) -> list[CompletionOutput]:
        for delta in output.outputs:
            job.choices.setdefault(delta.index, schemas.ChoiceState(delta.index)).add(delta)
        return output.outputs

    async def _collect(self, jobs: list[Job]) -> None:
        async def on_output(job: Job, output: RequestOutput) -> None:
            self._accumulate(job, output)
            await trio.lowlevel.checkpoint()

        for job in jobs:
            await _drain(job, on_output)
        self.outcome = _outcome(jobs)
        await send_json(self.request.send, 200, self.make_response(jobs, self._usage(jobs)))

    async def _stream(self, jobs: list[Job]) -> None:
        sse = SSEResponse(self.request.send)
        await sse.start()
        await self.on_start(sse, jobs)
        lock = trio.Lock()
        failures: list[Exception] = []

        async def on_output(job: Job, output: RequestOutput) -> None:
            for delta in self._accumulate(job, output):
                choice = self.on_delta(job, delta)
                if choice is not None:
                    async with lock:
                        await sse.event(self.make_chunk([choice], None))

        async def pump(job: Job, cancel: trio.CancelScope) -> None:
            # The engine died, or a bug: the stream ends with an error event.
            try:
                await _drain(job, on_output)
            except Exception as exc:
                failures.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(pump, job, nursery.cancel_scope)
        if failures:
            self.outcome = f"error: {type(failures[0]).__name__}"
            await sse.event(error_event(failures[0]))
            await sse.done()
            return
        self.outcome = _outcome(jobs)
        if self.include_usage:
            await sse.event(self.make_chunk([], self._usage(jobs)))
        await sse.done()


# ------------------------------------------------------------------ endpoints


async def create_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/completions``."""
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    typed = parse_request(protocol.CompletionRequest, body)
    parsed = schemas.parse_completion_request(body, max_n=state.settings.max_n)
    lora = select_model(state, parsed.model)
    constraint = output_constraint(typed)
    if constraint is not None:
        parsed.params = parsed.params.clone(structured_outputs=constraint)
    request_id = _new_id("cmpl")
    model = lora.lora_name if lora is not None else state.model_name
    n = parsed.params.n
    decode = decoder(state)
    renderer = state.engine.renderer

    def prompt_text(job: Job) -> str:
        if job.first.prompt is not None:
            return job.first.prompt
        return renderer.decode(job.first.prompt_token_ids or [], skip_special_tokens=False)

    def logprobs_of(token_ids: list[int], entries: Any, offset: int) -> dict[str, Any] | None:
        if parsed.logprobs is None:
            return None
        return schemas.completion_logprobs(token_ids, list(entries or ()), decode, offset)

    async def on_start(sse: SSEResponse, jobs: list[Job]) -> None:
        if parsed.echo:
            for job in jobs:
                job.prompt_text = prompt_text(job)
        await trio.lowlevel.checkpoint()

    def on_delta(job: Job, delta: CompletionOutput) -> dict[str, Any] | None:
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
            return None  # a token that is not text yet (part of a UTF-8 character)
        offset = job.text_offsets.get(delta.index, len(job.prompt_text))
        logprobs = logprobs_of(delta.token_ids, delta.logprobs, offset)
        if logprobs is not None:
            job.text_offsets[delta.index] = offset + sum(len(t) for t in logprobs["tokens"])
        return schemas.completion_choice(
            job.prompt_index * n + delta.index,
            echo + delta.text,
            logprobs,
            delta.finish_reason,
            delta.stop_reason,
        )

    def make_chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        # OpenAI's streamed completions are "text_completion" objects too.
        return schemas.openai_object(
            "text_completion",
            request_id,
            generation.created,
            model,
            choices,
            usage,
            include_usage=parsed.include_usage,
        )

    def make_response(jobs: list[Job], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for job in jobs:
            echo = prompt_text(job) if parsed.echo else ""
            for index in sorted(job.choices):
                choice = job.choices[index]
                logprobs = logprobs_of(choice.token_ids, choice.logprobs, len(echo))
                choices.append(
                    schemas.completion_choice(
                        job.prompt_index * n + index,
                        echo + choice.text,
                        logprobs,
                        choice.finish_reason,
                        choice.stop_reason,
                    )
                )
        return schemas.openai_object(
            "text_completion", request_id, generation.created, model, choices, usage
        )

    generation = Generation(
        state,
        request,
        request_id,
        model,
        [schemas.with_cache_salt(p, parsed.cache_salt) for p in parsed.prompts],
        parsed.params,
        parsed.priority,
        parsed.stream,
        parsed.include_usage,
        schemas.request_fields("completions", body),
        on_start,
        on_delta,
        make_chunk,
        make_response,
        lora,
    )
    await generation.run()


async def create_chat_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/chat/completions``."""
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    typed = parse_request(protocol.ChatCompletionRequest, body)
    parsed = schemas.parse_chat_request(body, max_n=state.settings.max_n)
    lora = select_model(state, parsed.model)
    settings = state.settings
    tools = plan_tools(
        typed.tools,
        typed.tool_choice,
        parallel_tool_calls=typed.parallel_tool_calls,
        auto_parser=settings.auto_tool_parser,
    )
    constraint = output_constraint(typed)
    if tools.constraint is not None:
        if constraint is not None:
            raise ValidationError("tool_choice", f"cannot be combined with {constraint.field}")
        constraint = tools.constraint
    if constraint is not None:
        parsed.params = parsed.params.clone(structured_outputs=constraint)
    messages = [message.for_template() for message in typed.messages]
    if typed.chat_template is not None:  # a caller's template is code: never on the loop
        rendered = await render_with_request_template(
            state, typed, messages, tools.template_tools, parsed.add_generation_prompt
        )
    else:
        rendered = await state.engine.render_chat_prompt(
            messages,
            add_generation_prompt=parsed.add_generation_prompt,
            chat_template=settings.chat_template,
            tools=tools.template_tools,
            template_kwargs=typed.chat_template_kwargs,
        )
    prompt = schemas.with_cache_salt(rendered, parsed.cache_salt)
    readers: dict[int, ChoiceReader] = {}

    def reader(index: int) -> ChoiceReader:
        if index not in readers:
            readers[index] = ChoiceReader(settings.reasoning, tools.parser)
        return readers[index]

    request_id = _new_id("chatcmpl")
    model = lora.lora_name if lora is not None else state.model_name
    decode = decoder(state)
    renames = schemas.request_fields("chat", body)

    def logprobs_of(token_ids: list[int], entries: Any) -> Any:
        if not parsed.logprobs:
            return None
        return schemas.chat_logprobs(token_ids, list(entries or ()), decode, parsed.top_logprobs)

    def make_chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return schemas.openai_object(
            "chat.completion.chunk",
            request_id,
            generation.created,
            model,
            choices,
            usage,
            include_usage=parsed.include_usage,
        )

    async def on_start(sse: SSEResponse, jobs: list[Job]) -> None:
        for index in range(parsed.params.n):
            delta = {"role": "assistant", "content": ""}
            await sse.event(make_chunk([schemas.chat_delta_choice(index, delta, None, None)], None))

    def on_delta(job: Job, delta: CompletionOutput) -> dict[str, Any] | None:
        finish_reason = delta.finish_reason
        choice = reader(delta.index)
        if choice.active:
            fields = choice.update(delta.text, final=finish_reason is not None)
            if choice.called_tools and finish_reason == "stop":
                finish_reason = "tool_calls"
            if not (fields or finish_reason or (delta.token_ids and parsed.logprobs)):
                return None  # held back (perhaps the start of a tag)
        elif not (delta.text or finish_reason or (delta.token_ids and parsed.logprobs)):
            return None  # a token that is not text yet (part of a UTF-8 character)
        else:
            fields = {"content": delta.text} if delta.text or finish_reason is None else {}
        return schemas.chat_delta_choice(
            delta.index,
            fields,
            logprobs_of(delta.token_ids, delta.logprobs),
            finish_reason,
            delta.stop_reason,
        )

    def make_response(jobs: list[Job], usage: dict[str, int]) -> dict[str, Any]:
        (job,) = jobs
        choices = []
        for index, choice in sorted(job.choices.items()):
            out = schemas.chat_choice(
                index,
                choice.text,
                logprobs_of(choice.token_ids, choice.logprobs),
                choice.finish_reason,
                choice.stop_reason,
            )
            fields, called = ChoiceReader(settings.reasoning, tools.parser).message(choice.text)
            out["message"].update(fields)
            if called and choice.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
            choices.append(out)
        return schemas.openai_object(
            "chat.completion", request_id, generation.created, model, choices, usage
        )

    generation = Generation(
        state,
        request,
        request_id,
        model,
        [prompt],
        parsed.params,
        parsed.priority,
        parsed.stream,
        parsed.include_usage,
        renames,
        on_start,
        on_delta,
        make_chunk,
        make_response,
        lora,
    )
    await generation.run()


async def list_models(request: Request, state: ServingState) -> None:
    """``GET /v1/models``: the served model, then its LoRA adapters."""
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "legato",
        "root": state.engine.model_name,
        "parent": None,
        "max_model_len": state.engine.config.max_model_len,
    }
    await send_json(request.send, 200, {"object": "list", "data": [card, *adapter_cards(state)]})


async def health(request: Request, state: ServingState) -> None:
    """``GET /health``: 200 while serving; 503 while the server drains or the engine is
    dead or restarting."""
    state.check_available()
    try:
        await state.engine.check_health()
    except EngineDeadError as exc:
        state.check_available()  # died just now: engine_restarting if supervised
        raise Unavailable("engine_dead", f"the engine is dead: {exc}") from None
    await send_json(request.send, 200, {"status": "ok"})


async def metrics(request: Request, state: ServingState) -> None:
    """``GET /metrics``: the engine's Prometheus metrics."""
    await send_body(request.send, 200, state.engine.stats.exposition(), CONTENT_TYPE_LATEST)


async def version(request: Request, state: ServingState) -> None:
    """``GET /version``."""
    await send_json(request.send, 200, {"version": __version__})


async def render_with_request_template(
    state: ServingState,
    typed: protocol.ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> dict[str, Any]:
    """The chat rendered with the request's own ``chat_template``: refused (400) unless the
    server trusts request templates, then rendered in a limited child process and
    tokenized off the loop when large. A checkpoint."""
    if not state.settings.trust_request_chat_template:
        raise ValidationError(
            "chat_template",
            "a per-request chat template is not accepted by this server "
            "(the operator may allow it with --trust-request-chat-template)",
        )
    renderer = state.engine.renderer
    special = {
        name: value
        for name, value in renderer.tokenizer.special_tokens_map.items()
        if isinstance(value, str)
    }
    assert typed.chat_template is not None
    text = await render_request_template(
        typed.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        special_tokens=special,
        template_kwargs=template_kwargs_of(typed.chat_template_kwargs),
    )
    # The template writes its own special tokens (BOS included): add none.
    ids = await state.tokenizing.encode(renderer, text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids}


async def tokenize(request: Request, state: ServingState) -> None:
    """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> tokens, count, max_model_len."""
    body = await request.json(state.settings.max_body_bytes)
    check_model(state, schemas.check_str("model", body["model"]) if body.get("model") else None)
    if body.get("messages") is not None:
        messages = schemas.parse_messages(body["messages"])
        add_generation_prompt = body.get("add_generation_prompt", True)
        schemas.check_bool("add_generation_prompt", add_generation_prompt)
        rendered = await state.engine.render_chat_prompt(
            messages, add_generation_prompt=add_generation_prompt
        )
        tokens = rendered["prompt_token_ids"]
    elif body.get("prompt") is not None:
        text = schemas.check_str("prompt", body["prompt"])
        add_special_tokens = body.get("add_special_tokens", True)
        schemas.check_bool("add_special_tokens", add_special_tokens)
        tokens = await state.tokenizing.encode(
            state.engine.renderer, text, add_special_tokens=add_special_tokens
        )
    else:
        raise ValidationError("prompt", "give 'prompt' or 'messages'")
    result = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": state.engine.config.max_model_len,
    }
    await send_json(request.send, 200, result)


async def detokenize(request: Request, state: ServingState) -> None:
    """``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
    body = await request.json(state.settings.max_body_bytes)
    check_model(state, schemas.check_str("model", body["model"]) if body.get("model") else None)
    tokens = schemas.check_ints("tokens", body.get("tokens"))
    try:
        text = await state.tokenizing.decode(state.engine.renderer, tokens)
    except ValidationError as exc:
        raise schemas.in_request_terms(exc, schemas.request_fields("detokenize", body)) from None
    await send_json(request.send, 200, {"prompt": text})
