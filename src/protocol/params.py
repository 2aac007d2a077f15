"""Request parameters: SamplingParams, PoolingParams, LoRARequest and RequestOutputKind.

Fields, names and defaults follow vLLM's ``SamplingParams`` so code written
against vLLM carries over. Every rule is checked at construction and a
violation raises ``ValidationError`` (a ``ValueError``) whose ``field`` is
vLLM's name of the field and whose ``reason`` says what is wrong.

Never imports torch or trio.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ValidationError
from .structured import StructuredOutputsParams

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How a stream reports progress."""

    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # a single output, when the request finishes


def _fail(field_name: str, reason: str) -> ValidationError:
    return ValidationError(field_name, reason)


def _as_list(field_name: str, value: Any) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise _fail(field_name, f"must be a list, got {type(value).__name__}")
    return list(value)


def _check_token_ids(field_name: str, ids: Sequence[int]) -> list[int]:
    out: list[int] = []
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise _fail(field_name, f"token ids must be integers, got {token_id!r}")
        if token_id < 0:
            raise _fail(field_name, f"token ids must be non-negative, got {token_id}")
        out.append(token_id)
    return out


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Mirrors vLLM's fields.

    ``max_tokens=None`` means "up to the model's context limit". ``stop`` may be
    a string or a list of strings and is stored as a list. ``best_of`` and
    ``logits_processors`` are accepted only at their defaults: this engine does
    not implement them and says so instead of silently ignoring them.
    ``structured_outputs`` (or its dict form) constrains the output to a JSON
    schema, regex, choice or grammar; whether it compiles is checked when the
    request is admitted (a ValidationError naming the field, for that request).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[Callable[..., Any]] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    extra_args: dict[str, Any] | None = field(default=None)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = _as_list("stop", self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", self.bad_words)
        if self.logit_bias is not None:
            try:
                self.logit_bias = dict(self.logit_bias)
            except (TypeError, ValueError):
                raise _fail("logit_bias", "must be a mapping of token id to bias") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise _fail("output_kind", f"unknown output kind {self.output_kind!r}") from None
        if isinstance(self.temperature, int | float) and 0 <= self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs have no effect; normalise them as vLLM does.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.validate()

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def validate(self) -> None:
        """Raise ValidationError naming the first field that breaks a rule."""
        _int("n", self.n, minimum=1)
        for flag in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            _bool(flag, getattr(self, flag))
        if self.best_of is not None and self.best_of != self.n:
            raise _fail("best_of", "is not supported (use n); only best_of == n is accepted")
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _num("repetition_penalty", self.repetition_penalty, None, None)
        if self.repetition_penalty <= 0.0:
            raise _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _num("temperature", self.temperature, 0.0, None)
        _num("top_p", self.top_p, None, None)
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, minimum=-1)
        _num("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, minimum=None, maximum=_MAX_SEED)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, minimum=1)
        _int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail(
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, minimum=-1)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, minimum=-1)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)
        if self.stop is not None:
            _check_strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_CHARS)
        if self.stop and not self.detokenize:
            raise _fail("stop", "stop strings need detokenize=True")
        if self.stop_token_ids is not None:
            self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", "must not be empty")
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.logit_bias is not None:
            _check_token_ids("logit_bias", list(self.logit_bias))
            for bias in self.logit_bias.values():
                _num("logit_bias", bias, None, None)
                if abs(bias) == float("inf"):
                    raise _fail("logit_bias", f"biases must be finite, got {bias}")
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}
        if self.bad_words is not None:
            _check_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_STOP_CHARS)
        if self.extra_args is not None:
            _check_json_object("extra_args", self.extra_args)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _fail(
                "structured_outputs",
                f"must be StructuredOutputsParams or a dict, got {type(self.structured_outputs).__name__}",
            )
        if self.logits_processors is not None:
            for proc in self.logits_processors:
                if not callable(proc):
                    raise _fail("logits_processors", f"must be callables, got {proc!r}")
            if self.logits_processors:
                raise _fail(
                    "logits_processors",
                    "per-request logits processors are not supported by this engine",
                )

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Raise ValidationError if a token id named in the params is outside the vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise _fail(
                        name, f"token id {token_id} is outside the vocabulary ({vocab_size})"
                    )

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        for key in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(values[key], list):
                values[key] = list(values[key])
        if isinstance(values["logit_bias"], dict):
            values["logit_bias"] = dict(values["logit_bias"])
        return SamplingParams(**values)


@dataclass
class PoolingParams:
    """Parameters for ``encode`` (pooling) requests."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify", "score", "encode"):
            raise _fail("task", f"unknown pooling task {self.task!r}")
        if self.dimensions is not None:
            _int("dimensions", self.dimensions, minimum=1)
        _bool("normalize", self.normalize)

    def check_servable(self, embedding_size: int | None) -> None:
        """Whether an engine that serves the "embed" task of a model giving
        ``embedding_size``-long vectors (not trained to be shortened) can serve these;
        ValidationError naming the field. ``embedding_size`` may be None when
        ``dimensions`` is not set (it is then not needed)."""
        if self.task != "embed":
            raise _fail("task", f"this engine serves the 'embed' pooling task, got {self.task!r}")
        if self.dimensions is not None and self.dimensions != embedding_size:
            raise _fail(
                "dimensions",
                f"this model gives {embedding_size}-dimensional embeddings and was not "
                "trained to be shortened (Matryoshka)",
            )


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter, with vLLM's fields: a name, a unique positive integer id and
    the local PEFT directory it loads from (``base_model_name``: the model it was
    trained on, shown as its parent in ``/v1/models``; the served model if None)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise _fail("lora_name", f"must be a non-empty string, got {self.lora_name!r}")
        _int("lora_int_id", self.lora_int_id, minimum=1)
        if not isinstance(self.lora_path, str):
            raise _fail("lora_path", f"must be a string, got {type(self.lora_path).__name__}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise _fail("base_model_name", "must be a string or None")


def check_lora_request(value: object, field_name: str = "lora_request") -> LoRARequest:
    """``value`` if it is a LoRARequest; else ValidationError naming ``field_name``.

    Every entry point that takes an adapter (generate, encode, get_tokenizer,
    add_lora) checks it here."""
    if not isinstance(value, LoRARequest):
        raise _fail(field_name, f"must be a LoRARequest, got {type(value).__name__}")
    return value


# Counts and sizes fit in int32 and seeds in int64, so no value that passes
# validation can overflow a tensor in the model worker (and kill the engine).
_MAX_COUNT = 2**31 - 1
_MAX_SEED = 2**63 - 1


def _int(name: str, value: object, *, minimum: int | None, maximum: int = _MAX_COUNT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _fail(name, f"must be >= {minimum}, got {value}")
    if value > maximum or value < -maximum - 1:
        raise _fail(name, f"must be <= {maximum}, got {value}")


# Stop strings are checked against each sequence's text on every step, on the event loop:
# bounded so that a request's worst case stays a few milliseconds a step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MAX_BAD_WORDS = 64


def _check_strings(name: str, values: list[Any], max_count: int, max_chars: int) -> None:
    if len(values) > max_count:
        raise _fail(name, f"at most {max_count} strings are accepted, got {len(values)}")
    for value in values:
        if not isinstance(value, str) or not value:
            raise _fail(name, f"must be non-empty strings, got {type(value).__name__}")
        if len(value) > max_chars:
            raise _fail(name, f"each string must be at most {max_chars} characters")


# ``extra_args`` is free-form: bounded so that no value can be costly to copy or check.
MAX_EXTRA_ARGS_ITEMS = 256
MAX_EXTRA_ARGS_DEPTH = 8
MAX_EXTRA_ARGS_CHARS = 64 * 1024


def _check_json_object(name: str, value: object) -> None:
    """``value`` must be a JSON object: string keys; values None, bools, int64 ints,
    finite floats, strings, lists and objects; at most MAX_EXTRA_ARGS_ITEMS values,
    MAX_EXTRA_ARGS_DEPTH levels and MAX_EXTRA_ARGS_CHARS characters of strings."""
    if not isinstance(value, dict):
        raise _fail(name, f"must be an object, got {type(value).__name__}")
    items = chars = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > MAX_EXTRA_ARGS_ITEMS:
            raise _fail(name, f"holds more than {MAX_EXTRA_ARGS_ITEMS} values")
        if node is None or isinstance(node, bool):
            continue
        if isinstance(node, int):
            if not -(2**63) <= node < 2**63:
                raise _fail(name, "integers must fit in 64 bits (signed)")
        elif isinstance(node, float):
            if node != node or node in (float("inf"), float("-inf")):
                raise _fail(name, f"numbers must be finite, got {node}")
        elif isinstance(node, str):
            chars += len(node)
        elif isinstance(node, list | dict):
            if depth >= MAX_EXTRA_ARGS_DEPTH:
                raise _fail(name, f"is nested deeper than {MAX_EXTRA_ARGS_DEPTH} levels")
            if isinstance(node, dict):
                for key in node:
                    if not isinstance(key, str):
                        raise _fail(name, f"keys must be strings, got {type(key).__name__}")
                    chars += len(key)
                children = list(node.values())
            else:
                children = node
            stack.extend((child, depth + 1) for child in children[: MAX_EXTRA_ARGS_ITEMS + 1])
        else:
            raise _fail(name, f"values must be JSON values, got {type(node).__name__}")
        if chars > MAX_EXTRA_ARGS_CHARS:
            raise _fail(name, f"holds more than {MAX_EXTRA_ARGS_CHARS} characters")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(name, f"must be true or false, got {value!r}")


def _num(name: str, value: object, low: float | None, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(name, f"must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise _fail(name, f"must be a finite number, got {value}")
    if low is not None and value < low:
        raise _fail(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise _fail(name, f"must be <= {high}, got {value}")
