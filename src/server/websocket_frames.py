"""The WebSocket protocol's frames: decoding and encoding them (JSON text or msgpack
binary), parsing ``generate`` frames, and the ``output`` and ``error`` frames the
server sends (see ``docs/websocket.md``; the connections are ``websocket``'s).

A ``generate`` frame is parsed by its pydantic model (:class:`GenerateFrame`) once
its ``request_id`` is known good; its ``params`` by ``GenerateParams``, the model
whose ``to_sampling_params`` the HTTP bodies share. msgpack is decoded with size
limits and without ext types; nothing is pickled.

Imports no trio and never torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgpack
import pydantic
from pydantic import Field

from ..protocol.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineGenerateError,
    ValidationError,
)
from ..protocol.outputs import CompletionOutput, RequestOutput
from ..protocol.params import LoRARequest, SamplingParams
from .asgi import LONE_SURROGATE, HTTPError, dumps, has_lone_surrogate
from .lora_routes import select_model
from .openai_protocol import ChatMessage, GenerateParams, Int64, OpenAIModel, validation_error
from .openai_schemas import show
from .state import ServingState, Unavailable

logger = logging.getLogger("legato.server")

Encoding = Literal["json", "msgpack"]

HARD_LIMIT_FACTOR = 4
"""trio-websocket closes the connection (1009) for frames over this many times the soft limit."""

MAX_REQUEST_ID_LEN = 256

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_FIXED_PARAMS = frozenset({"output_kind", "logits_processors"})


class FrameError(Exception):
    """A client frame the server refuses: becomes an ``error`` frame."""

    def __init__(
        self, code: str, message: str, *, request_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.param = param

    @classmethod
    def invalid(cls, exc: ValidationError, request_id: str | None = None) -> FrameError:
        """An ``invalid_request`` error whose ``param`` is the error's field."""
        return cls("invalid_request", str(exc), request_id=request_id, param=exc.field)

    def frame(self) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message}
        if self.request_id is not None:
            frame["request_id"] = self.request_id
        if self.param is not None:
            frame["param"] = self.param
        return frame


def encode_frame(value: Mapping[str, Any], encoding: Encoding) -> str | bytes:
    """A server frame: a JSON text frame or a msgpack binary frame."""
    if encoding == "json":
        return dumps(value).decode()
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not accepted")


def decode_frame(message: str | bytes, limit: int) -> tuple[dict[str, Any], Encoding]:
    """A client frame as an object, and its encoding. Raises FrameError (never anything else)."""
    encoding: Encoding = "json" if isinstance(message, str) else "msgpack"
    size = len(message.encode()) if isinstance(message, str) else len(message)
    if size > limit:
        raise FrameError("frame_too_large", f"the frame is {size} bytes, over the limit of {limit}")
    try:
        if isinstance(message, str):
            value = json.loads(message)
        else:
            value = msgpack.unpackb(
                message,
                raw=False,
                use_list=True,
                strict_map_key=False,
                ext_hook=_no_ext,
                max_str_len=size,
                max_bin_len=size,
                max_array_len=size,
                max_map_len=size // 2,
                max_ext_len=size,
            )
    except Exception as exc:  # any malformed input: ValueError, RecursionError, UnpackException...
        raise FrameError(
            "invalid_frame", f"not valid {encoding}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(value, dict):
        raise FrameError("invalid_frame", "a frame must be an object")
    if encoding == "json" and has_lone_surrogate(value):
        raise FrameError("invalid_frame", f"not valid json: {LONE_SURROGATE}")
    return value, encoding


@dataclasses.dataclass
class GenerateRequest:
    """A validated ``generate`` frame."""

    request_id: str
    prompt: str | dict[str, Any]
    params: SamplingParams
    priority: int
    encoding: Encoding
    lora_request: LoRARequest | None = None  # the adapter the frame's ``model`` names
    messages: list[dict[str, Any]] | None = None
    """A chat, rendered by the request's own task (a large one takes a while); ``prompt``
    then holds the fields the rendered chat is completed with (``cache_salt``)."""


class GenerateFrame(OpenAIModel):
    """A ``generate`` frame (its ``request_id`` checked first, ``type`` and unknown fields
    ignored). ``prompt_token_ids`` are the engine's to check."""

    prompt: str | None = None
    prompt_token_ids: Any = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    cache_salt: str | None = Field(default=None, min_length=1)
    params: GenerateParams | None = None
    priority: Int64 = 0
    model: str | None = None

    def engine_prompt(self) -> tuple[str | dict[str, Any], list[dict[str, Any]] | None]:
        """The prompt (a chat: ``{}`` plus ``cache_salt``, rendered later) and the chat."""
        given = [
            name
            for name, value in (
                ("prompt", self.prompt),
                ("prompt_token_ids", self.prompt_token_ids),
                ("messages", self.messages),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValidationError(
                "prompt", "give exactly one of 'prompt', 'prompt_token_ids', 'messages'"
            )
        prompt: str | dict[str, Any]
        messages = None
        if self.prompt is not None:
            prompt = self.prompt
        elif self.messages is not None:
            messages, prompt = [m.for_template() for m in self.messages], {}
        else:
            prompt = {"prompt_token_ids": self.prompt_token_ids}
        if self.cache_salt is not None:
            prompt = {"prompt": prompt} if isinstance(prompt, str) else prompt
            prompt["cache_salt"] = self.cache_salt
        return prompt, messages


def parse_generate(
    frame: Mapping[str, Any], state: ServingState, encoding: Encoding
) -> GenerateRequest:
    """Validate a ``generate`` frame. Raises FrameError naming the field."""
    request_id = frame.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise FrameError(
            "invalid_request",
            f"request_id: must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters",
            param="request_id",
        )

    def invalid(param: str, reason: str) -> FrameError:
        return FrameError.invalid(ValidationError(param, reason), request_id)

    raw = frame.get("params")
    if raw is not None and not isinstance(raw, dict):
        raise invalid("params", "must be an object of SamplingParams fields")
    for key in raw or ():  # the field set first: these two errors say more than "extra field"
        if key in _FIXED_PARAMS:
            raise invalid(f"params.{key}", "cannot be set over the WebSocket protocol")
        if key not in GenerateParams.model_fields:
            name = key if isinstance(key, str) else show(key)  # msgpack keys may be anything
            raise invalid(f"params.{name}", "is not a SamplingParams field")
    try:
        typed = GenerateFrame.model_validate(frame)  # the one parse of the frame
        prompt, messages = typed.engine_prompt()
    except pydantic.ValidationError as exc:
        raise FrameError.invalid(validation_error(exc), request_id) from None
    except ValidationError as exc:
        raise FrameError.invalid(exc, request_id) from None
    try:
        params = (typed.params or GenerateParams()).to_sampling_params(max_n=state.settings.max_n)
    except ValidationError as exc:
        raise FrameError.invalid(exc.under("params"), request_id) from None
    except (ValueError, TypeError) as exc:  # a rule that forgot to name its field: a bug
        raise invalid("params", f"{type(exc).__name__}: {exc}") from None
    try:
        lora = select_model(state, typed.model)
    except HTTPError as exc:
        raise FrameError(
            "model_not_found", exc.message, request_id=request_id, param="model"
        ) from None
    return GenerateRequest(request_id, prompt, params, typed.priority, encoding, lora, messages)


def embed_request_id(frame: Mapping[str, Any]) -> str:
    """An ``embed`` frame's ``request_id``; FrameError naming it if it is bad. The rest of
    the frame is checked by its task (:meth:`Connection._serve_embed`)."""
    request_id = frame.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise FrameError(
            "invalid_request",
            f"request_id: must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters",
            param="request_id",
        )
    return request_id


def in_frame_terms(exc: ValidationError) -> ValidationError:
    """An engine error's field as the ``generate`` frame names it: the prompt's fields
    are ``prompt``, SamplingParams' are under ``params`` (``params.structured_outputs.json``)."""
    if exc.field in ("prompt", "prompt_token_ids"):
        return exc.renamed("prompt")
    if exc.field.partition(".")[0] in _PARAM_FIELDS:
        return exc.under("params")
    return exc


def in_embed_terms(exc: ValidationError) -> ValidationError:
    """An engine error's field as the ``embed`` frame names it: the prompt is ``input``."""
    return exc.renamed("input") if exc.field in ("prompt", "prompt_token_ids") else exc


def request_error(
    exc: Exception, engine_id: str, in_terms: Callable[[ValidationError], ValidationError]
) -> FrameError:
    """The ``error`` frame for what ended a request's task (call it in the ``except``
    block: an unexpected error is logged with its traceback). ``in_terms`` names a
    bad field as the request's frame does."""
    if isinstance(exc, Unavailable):
        return FrameError(exc.code, exc.message)
    if isinstance(exc, ValidationError):
        return FrameError.invalid(in_terms(exc))
    if isinstance(exc, EngineDeadError):
        return FrameError("engine_dead", f"the engine is dead: {exc}")
    if isinstance(exc, EngineBusyError):  # the engine's admission bound: retry later
        return FrameError("server_busy", str(exc))
    if isinstance(exc, EngineGenerateError | ValueError):
        return FrameError("invalid_request", str(exc))
    logger.exception("request %s failed", engine_id)  # the detail stays in the server log
    return FrameError("internal_error", f"internal error (request {engine_id})")


def output_frames(
    request_id: str, output: RequestOutput, usage: dict[str, int] | None
) -> list[dict[str, Any]]:
    """The ``output`` frames for one engine step: one per completion with news.

    ``finished`` is true on the request's last frame only, which also
    carries ``usage`` (given when the request finished).
    """
    news = [c for c in output.outputs if c.text or c.token_ids or c.finish_reason is not None]
    if output.finished and not news:
        news = [CompletionOutput(index=0, text="", token_ids=[])]
    frames = []
    for i, completion in enumerate(news):
        frame: dict[str, Any] = {
            "type": "output",
            "request_id": request_id,
            "index": completion.index,
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "finished": output.finished and i == len(news) - 1,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if completion.logprobs is not None:
            frame["logprobs"] = [
                [
                    {
                        "token_id": tid,
                        "logprob": lp.logprob,
                        "rank": lp.rank,
                        "token": lp.decoded_token,
                    }
                    for tid, lp in position.items()
                ]
                for position in completion.logprobs
            ]
        if frame["finished"] and usage is not None:
            frame["usage"] = usage
        frames.append(frame)
    return frames
