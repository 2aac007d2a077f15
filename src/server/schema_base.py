"""The rules every request body model follows, and the one way a body is parsed.

:class:`OpenAIModel`: strict types (no coercion: ``"1"`` is not a number, ``true``
is not an integer), unknown fields ignored as OpenAI and vLLM do. Unions that a JSON
value's type decides are tagged by that type (:func:`by_json_type`), so an error
points into the member that applies. :func:`parse_request` validates a decoded body
and turns pydantic's first error into our one ``ValidationError``, naming the field
the way a client reads it (``messages[0].content``, :func:`field_path`).

Pure code: never imports trio or torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ..protocol.errors import ValidationError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""Integers a client gives must fit in 64 bits: the engine stores them in int64 arrays."""

_TAG = "§"  # prefix of union tags in error locations; :func:`field_path` drops them

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)

MAX_PROMPTS = 256
"""At most this many prompts in one ``/v1/completions`` request."""

PromptInput = str | dict[str, Any]

MAX_TOOLS = 128
"""The most tools a request may declare (their checks and the template grow with it)."""


def _json_type(value: Any) -> str | None:
    for python_type, name in _JSON_TYPES:
        if isinstance(value, python_type):
            return _TAG + name
    return None


def by_json_type(message: str, **members: Any) -> Any:
    """A union whose member is picked by the input's JSON type (``string=str, array=list[X]``).

    Any other type is one error, ``message``, located at the field itself.
    """
    tagged = tuple(Annotated[member, Tag(_TAG + name)] for name, member in members.items())
    return Annotated[
        Union[tagged],  # noqa: UP007 - a runtime-built union
        Discriminator(_json_type, custom_error_type="invalid_type", custom_error_message=message),
    ]


class OpenAIModel(BaseModel):
    """Strict types; unknown fields ignored (forward compatibility, as OpenAI and vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class OpenAIResponseModel(BaseModel):
    """What the server sends; lenient on input, since it only documents and checks our output."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------ errors


def field_path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(_TAG):
            out += f".{part}" if out else part
    return out


def _message(error: Any) -> str:
    kind, text = error["type"], error["msg"]
    if kind == "missing":
        return "is required"
    if kind == "too_short":
        return "must not be empty" if error["ctx"].get("min_length") == 1 else str(text)
    if kind == "literal_error":
        return f"must be {text.removeprefix('Input should be ')}"
    if kind == "value_error":
        return str(text).removeprefix("Value error, ")
    return str(text).replace("Input should be", "must be", 1)


def validation_error(exc: pydantic.ValidationError) -> ValidationError:
    """Our one validation error (field + reason) for pydantic's first error."""
    first = exc.errors(include_url=False)[0]
    path = field_path(tuple(first["loc"])) or "body"
    return ValidationError(path, _message(first))


def parse_request(model: type[OpenAIModel], body: object) -> Any:
    """Validate a decoded JSON body as ``model``; ValidationError naming the field if it is not."""
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
