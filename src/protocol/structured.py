"""StructuredOutputsParams: what a request's output must match, shaped like vLLM's.

Exactly one constraint is given: ``json`` (a JSON Schema, as a dict or its
JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
a list of strings) or ``grammar`` (Lark, or llama.cpp's GBNF/EBNF). The
options beside them follow vLLM's names. Construction checks the *shape*
(types, exactly one constraint) and raises ``ValidationError`` naming the
field as ``structured_outputs.<name>``; whether a schema or grammar is
*valid* is the grammar engine's verdict, at compile time
(:mod:`legato.structured.grammar`).

Never imports torch or trio.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

from .errors import ValidationError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint fields; exactly one is set."""

MAX_SPEC_CHARS = 1 << 20
"""A schema, regex or grammar larger than this (as text) is refused before compiling."""

SPEC_LIMITS: dict[str, int] = {
    "json": 256 * 1024,
    "regex": 16 * 1024,
    "grammar": 32 * 1024,
    "choice": 64 * 1024,
    "json_object": 2,
}
"""The largest constraint of each kind, as text. Chosen so that the parts of compiling
that hold the interpreter (JSON parsing, GBNF-to-Lark conversion) cost tens of
milliseconds at worst; ``benchmarks/hostile_specs.py`` prints the figures."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint.

    ``field`` is how errors name this object to the caller (``response_format``,
    ``structured_outputs``); ``spec_field`` how they name the constraint itself
    (default ``<field>.<kind>``; a tool's schema is ``tools[0].function.parameters``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    field: str = "structured_outputs"
    spec_field: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(
                self.field,
                f"exactly one of {', '.join(KINDS)} must be given, got"
                f" {', '.join(given) if given else 'none'}",
            )
        self._check_shapes()

    @property
    def kind(self) -> str:
        """The name of the constraint that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def name(self, sub: str) -> str:
        """The caller-facing name of one of this object's fields."""
        return f"{self.field}.{sub}" if sub else self.field

    @property
    def spec_name(self) -> str:
        """How errors about the constraint (a bad schema, a bad grammar) name it."""
        return self.spec_field or self.name(self.kind)

    def spec_text(self) -> str:
        """The constraint as text: a key for caches and for size limits."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            return "{}"
        if isinstance(value, str):
            return value
        return _json.dumps(value, sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The non-default fields, for the wire (msgpack) and for logs."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = value
        return out

    def _check_shapes(self) -> None:
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValidationError(
                self.name("json"), f"must be a JSON Schema object, got {type(self.json).__name__}"
            )
        if isinstance(self.json, str):
            try:
                parsed = _json.loads(self.json)
            except ValueError as exc:
                raise ValidationError(self.name("json"), f"is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict | bool):
                raise ValidationError(self.name("json"), "must be a JSON Schema object")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValidationError(
                    self.name(name), f"must be a string, got {type(value).__name__}"
                )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValidationError(self.name("choice"), "must be a non-empty list of strings")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValidationError(self.name(name), f"must be true or false, got {value!r}")
        limit = min(MAX_SPEC_CHARS, SPEC_LIMITS[self.kind])
        if len(self.spec_text()) > limit:
            raise ValidationError(self.spec_name, f"is larger than {limit} characters")

    @classmethod
    def from_dict(
        cls, value: object, *, field: str = "structured_outputs"
    ) -> StructuredOutputsParams:
        """Build from a caller's mapping (JSON body, WebSocket frame); errors name ``field``."""
        if not isinstance(value, dict):
            raise ValidationError(field, f"must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)} - {"field", "spec_field"}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValidationError(f"{field}.{unknown[0]}", "is not a structured outputs option")
        return cls(**{k: v for k, v in value.items() if v is not None}, field=field)
