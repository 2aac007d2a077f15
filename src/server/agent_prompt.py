"""``plan_and_render``: what the agent APIs (``/v1/responses``, ``/v1/messages``) do
between parsing a body and generating: plan the tools, pick the output constraint,
check the parameters, render the chat prompt. Each API gives its own names for the
fields it reports. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..protocol.errors import ValidationError
from ..protocol.params import SamplingParams
from ..protocol.structured import StructuredOutputsParams
from .openai_protocol import NamedToolChoice, ToolParam
from .openai_schemas import in_request_terms
from .state import ServingState
from .tool_choice import ToolPlan, plan_tools


class AgentRequest(Protocol):
    """What ``plan_and_render`` reads of a parsed agent-API request."""

    @property
    def tools(self) -> Sequence[Any] | None: ...

    def output_constraint(self) -> StructuredOutputsParams | None: ...

    def to_sampling_params(
        self, structured_outputs: StructuredOutputsParams | None
    ) -> SamplingParams: ...

    def chat_messages(self) -> list[dict[str, Any]]: ...


async def plan_and_render(
    state: ServingState,
    typed: AgentRequest,
    tools_in: list[ToolParam] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
    *,
    renames: Mapping[str, str],
    format_field: str,
    parameters_field: str,
) -> tuple[ToolPlan, dict[str, Any], SamplingParams, dict[str, str]]:
    """The tool plan, the rendered prompt, the parameters and the field renames.

    ``renames`` maps engine fields to the request's; each tool's parameters are
    reported as ``tools[i].<parameters_field>``, and a tool choice that clashes
    with the API's structured output names ``format_field``. Raises
    ValidationError in the request's terms, before anything is rendered.
    """
    settings = state.settings
    try:
        tools = plan_tools(
            tools_in, choice, parallel_tool_calls=parallel, auto_parser=settings.auto_tool_parser
        )
    except ValidationError as exc:
        raise exc.renamed(exc.field.replace("tool_choice.function.", "tool_choice.")) from None
    constraint = typed.output_constraint()
    if tools.constraint is not None:
        if constraint is not None:
            raise ValidationError("tool_choice", f"cannot be combined with {format_field}")
        constraint = tools.constraint
    all_renames = dict(renames)
    for index in range(len(typed.tools or ())):  # the chat shape's paths, back in this API's
        all_renames[f"tools[{index}].function.parameters"] = f"tools[{index}].{parameters_field}"
    try:  # the range checks, before rendering anything
        params = typed.to_sampling_params(constraint)
    except ValidationError as exc:
        raise in_request_terms(exc, all_renames) from None
    rendered = await state.engine.render_chat_prompt(
        typed.chat_messages(),
        add_generation_prompt=True,
        chat_template=settings.chat_template,
        tools=tools.template_tools,
    )
    return tools, rendered, params, all_renames
