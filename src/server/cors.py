"""CORS for the HTTP API, configured as vLLM's server is.

``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` (each a
JSON list) and ``--allow-credentials`` (off by default) build one
:class:`CORSPolicy`. Unlike vLLM, no origin is allowed by default: a web page
in the user's browser must not read the API's answers; ``["*"]`` is an explicit
opt-in (the CLI warns when it comes without ``--api-key``). It answers preflight requests
(``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) itself,
and adds the ``Access-Control-Allow-*`` headers to every other response whose
request carried an allowed ``Origin``; the semantics follow Starlette's
``CORSMiddleware`` (which vLLM uses), so browsers see the same answers:

- an allowed preflight gets 200 with the allowed origin, methods, headers,
  ``Access-Control-Max-Age`` and ``Vary: Origin``; a disallowed one gets 400
  naming what was refused;
- with credentials allowed, a wildcard origin is answered with the request's
  own origin (browsers refuse ``*`` with credentials).

Pure code: headers are ``(bytes, bytes)`` pairs as in ASGI; never imports trio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

Headers = list[tuple[bytes, bytes]]

SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
MAX_AGE = 600


def parse_list_flag(name: str, value: str) -> tuple[str, ...]:
    """A ``--allowed-*`` flag's value: a JSON list of strings (``'["*"]'``) or a comma list."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            raise ValueError(f"{name}: not a JSON list: {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{name}: must be a JSON list of strings, got {value!r}")
        return tuple(items)
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class CORSPolicy:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def any_origin(self) -> bool:
        return "*" in self.allowed_origins

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin in self.allowed_origins

    def _allow_origin(self, origin: str) -> bytes:
        if self.any_origin and not self.allow_credentials:
            return b"*"
        return origin.encode("latin-1")

    def _vary(self) -> Headers:
        # The answer depends on the Origin unless it is a plain "*".
        return [] if self.any_origin and not self.allow_credentials else [(b"vary", b"Origin")]

    def preflight(
        self, origin: str, method: str, request_headers: str | None
    ) -> tuple[int, Headers, str]:
        """The answer to a preflight: ``(status, headers, body text)``."""
        methods = ALL_METHODS if "*" in self.allowed_methods else self.allowed_methods
        headers: Headers = [
            (b"access-control-allow-methods", ", ".join(methods).encode()),
            (b"access-control-max-age", str(MAX_AGE).encode()),
            *self._vary(),
        ]
        if self.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        refused = []
        if self.origin_allowed(origin):
            headers.append((b"access-control-allow-origin", self._allow_origin(origin)))
        else:
            refused.append("origin")
        if method.upper() not in {m.upper() for m in methods}:
            refused.append("method")
        asked = [h.strip().lower() for h in (request_headers or "").split(",") if h.strip()]
        if "*" in self.allowed_headers:
            if asked:
                headers.append(
                    (b"access-control-allow-headers", ", ".join(asked).encode("latin-1"))
                )
        else:
            allowed = SAFELISTED_HEADERS | {h.lower() for h in self.allowed_headers}
            if any(h not in allowed for h in asked):
                refused.append("headers")
            headers.append(
                (b"access-control-allow-headers", ", ".join(sorted(allowed)).encode("latin-1"))
            )
        if refused:
            return 400, headers, "Disallowed CORS " + ", ".join(refused)
        return 200, headers, "OK"

    def response_headers(self, origin: str | None) -> Headers:
        """Headers to add to an ordinary response to a request with ``Origin: origin``."""
        if origin is None or not self.origin_allowed(origin):
            return []
        headers = [(b"access-control-allow-origin", self._allow_origin(origin)), *self._vary()]
        if self.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        headers.append((b"access-control-expose-headers", b"X-Request-Id"))
        return headers


def is_preflight(method: str, origin: str | None, request_method: str | None) -> bool:
    """Whether a request is a CORS preflight (not just any OPTIONS)."""
    return method == "OPTIONS" and origin is not None and request_method is not None
