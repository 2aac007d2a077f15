"""``POST /v1/chat/completions``: messages in, ``chat.completion`` objects (or chunks) out.

The chat is rendered with the template (the server's, or a request's own when the
operator trusts them, in a limited child process), the output read by the
reasoning parser and the tool parser of ``tool_choice`` (:class:`ChoiceReader`), one
reader per choice. A streamed answer starts with one role chunk per choice.

Imports trio; never torch.
"""

from __future__ import annotations

from typing import Any

from ..frontend.renderer import template_kwargs_of
from ..protocol.errors import ValidationError
from ..protocol.outputs import CompletionOutput
from ..protocol.params import SamplingParams
from . import openai_protocol as protocol
from . import openai_schemas as schemas
from .asgi import Request
from .chat_outputs import ChoiceReader, output_constraint
from .chat_template_sandbox import render_request_template
from .lora_routes import select_model
from .openai_protocol import parse_request
from .serving_base import Job, SSEEvent, StreamingGeneration, decoder, new_id
from .state import ServingState
from .tool_choice import ToolPlan, plan_tools


class ChatServing(StreamingGeneration):
    """A chat completions request."""

    def __init__(
        self,
        state: ServingState,
        request: Request,
        parsed: protocol.ChatCompletionRequest,
        tools: ToolPlan,
        **kwargs: Any,
    ) -> None:
        super().__init__(state, request, **kwargs)
        self.parsed = parsed
        self.tools = tools
        self.decode = decoder(state)
        self.readers: dict[int, ChoiceReader] = {}

    def _reader(self, index: int) -> ChoiceReader:
        if index not in self.readers:
            self.readers[index] = self._new_reader()
        return self.readers[index]

    def _new_reader(self) -> ChoiceReader:
        return ChoiceReader(self.state.settings.reasoning, self.tools.parser)

    def _logprobs(self, token_ids: list[int], entries: Any) -> Any:
        if not self.parsed.logprobs:
            return None
        return schemas.chat_logprobs(
            token_ids, list(entries or ()), self.decode, self.parsed.top_logprobs or 0
        )

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> SSEEvent:
        chunk = schemas.openai_object(
            "chat.completion.chunk",
            self.request_id,
            self.created,
            self.model,
            choices,
            usage,
            include_usage=self.parsed.include_usage,
        )
        return None, chunk

    def start_events(self, jobs: list[Job]) -> list[SSEEvent]:
        role = {"role": "assistant", "content": ""}
        return [
            self._chunk([schemas.chat_delta_choice(index, role, None, None)], None)
            for index in range(self.params.n)
        ]

    def delta_events(self, job: Job, delta: CompletionOutput) -> list[SSEEvent]:
        finish_reason = delta.finish_reason
        logprobs_wanted = delta.token_ids and self.parsed.logprobs
        choice = self._reader(delta.index)
        if choice.active:
            fields = choice.update(delta.text, final=finish_reason is not None)
            if choice.called_tools and finish_reason == "stop":
                finish_reason = "tool_calls"
            if not (fields or finish_reason or logprobs_wanted):
                return []  # held back (perhaps the start of a tag)
        elif not (delta.text or finish_reason or logprobs_wanted):
            return []  # a token that is not text yet (part of a UTF-8 character)
        else:
            fields = {"content": delta.text} if delta.text or finish_reason is None else {}
        out = schemas.chat_delta_choice(
            delta.index,
            fields,
            self._logprobs(delta.token_ids, delta.logprobs),
            finish_reason,
            delta.stop_reason,
        )
        return [self._chunk([out], None)]

    def end_events(self, jobs: list[Job]) -> list[SSEEvent]:
        if not self.parsed.include_usage:
            return []
        return [self._chunk([], schemas.usage(*self.token_counts(jobs)))]

    def response(self, jobs: list[Job]) -> dict[str, Any]:
        (job,) = jobs
        choices = []
        for index, choice in sorted(job.choices.items()):
            out = schemas.chat_choice(
                index,
                choice.text,
                self._logprobs(choice.token_ids, choice.logprobs),
                choice.finish_reason,
                choice.stop_reason,
            )
            fields, called = self._new_reader().message(choice.text)
            out["message"].update(fields)
            if called and choice.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
            choices.append(out)
        usage = schemas.usage(*self.token_counts(jobs))
        return schemas.openai_object(
            "chat.completion", self.request_id, self.created, self.model, choices, usage
        )


async def plan_and_render_chat(
    state: ServingState, typed: protocol.ChatCompletionRequest
) -> tuple[ToolPlan, SamplingParams, dict[str, Any]]:
    """The tool plan, the parameters (with the output constraint) and the rendered chat
    of a parsed chat request. Raises ValidationError naming the request's field. A
    checkpoint."""
    settings = state.settings
    params = typed.to_sampling_params(max_n=settings.max_n)  # the constraint comes below
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
        params = params.clone(structured_outputs=constraint)
    add_generation_prompt = typed.add_generation_prompt is not False
    messages = [message.for_template() for message in typed.messages]
    if typed.chat_template is not None:  # a caller's template is code: never on the loop
        rendered = await render_with_request_template(
            state, typed, messages, tools.template_tools, add_generation_prompt
        )
    else:
        rendered = await state.engine.render_chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=settings.chat_template,
            tools=tools.template_tools,
            template_kwargs=typed.chat_template_kwargs,
        )
    return tools, params, rendered


async def create_chat_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/chat/completions``."""
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    typed: protocol.ChatCompletionRequest = parse_request(protocol.ChatCompletionRequest, body)
    lora = select_model(state, typed.model)
    tools, params, rendered = await plan_and_render_chat(state, typed)
    serving = ChatServing(
        state,
        request,
        typed,
        tools,
        request_id=new_id("chatcmpl"),
        model=lora.lora_name if lora is not None else state.model_name,
        prompts=[typed.with_cache_salt(rendered)],
        params=params,
        priority=typed.priority or 0,
        stream=bool(typed.stream),
        renames=typed.renames(),
        lora_request=lora,
    )
    await serving.run()


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
    special = dict(state.engine.model_info().special_tokens)
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
    ids = await state.engine.tokenize(text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids}
