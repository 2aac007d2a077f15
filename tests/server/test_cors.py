"""CORS answers as Starlette's CORSMiddleware (vLLM's) gives them."""

from __future__ import annotations

import pytest

from legato.server.cors import CORSPolicy, is_preflight, parse_list_flag


def _h(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in headers}


def test_default_policy_allows_no_origin() -> None:
    """Off by default (unlike vLLM): no page may read the API's answers (F7)."""
    policy = CORSPolicy()
    status, headers, body = policy.preflight("http://a.example", "POST", "Content-Type")
    assert status == 400 and body == "Disallowed CORS origin"
    assert "access-control-allow-origin" not in _h(headers)
    assert policy.response_headers("http://a.example") == []


def test_any_origin_policy_allows_everything_without_credentials() -> None:
    policy = CORSPolicy(allowed_origins=("*",))
    status, headers, _ = policy.preflight("http://a.example", "POST", "Content-Type, Authorization")
    h = _h(headers)
    assert status == 200
    assert h["access-control-allow-origin"] == "*"
    assert "POST" in h["access-control-allow-methods"]
    assert h["access-control-allow-headers"] == "content-type, authorization"
    assert "access-control-allow-credentials" not in h and "vary" not in h
    assert _h(policy.response_headers("http://a.example"))["access-control-allow-origin"] == "*"
    assert policy.response_headers(None) == []


def test_credentials_echo_the_origin() -> None:
    policy = CORSPolicy(allowed_origins=("*",), allow_credentials=True)
    h = _h(policy.response_headers("http://a.example"))
    assert h["access-control-allow-origin"] == "http://a.example"
    assert h["access-control-allow-credentials"] == "true" and h["vary"] == "Origin"


def test_restricted_policy_refuses_by_name() -> None:
    policy = CORSPolicy(
        allowed_origins=("http://ok.example",),
        allowed_methods=("POST",),
        allowed_headers=("x-key",),
    )
    assert policy.preflight("http://ok.example", "POST", "X-Key")[0] == 200
    status, headers, body = policy.preflight("http://evil.example", "DELETE", "X-Other")
    assert status == 400 and body == "Disallowed CORS origin, method, headers"
    assert "access-control-allow-origin" not in _h(headers)
    assert policy.response_headers("http://evil.example") == []
    assert _h(policy.response_headers("http://ok.example"))["vary"] == "Origin"


def test_preflight_detection() -> None:
    assert is_preflight("OPTIONS", "http://a", "POST")
    assert not is_preflight("OPTIONS", None, "POST") and not is_preflight("GET", "http://a", "POST")


def test_flag_parsing() -> None:
    assert parse_list_flag("--allowed-origins", '["http://a", "http://b"]') == (
        "http://a",
        "http://b",
    )
    assert parse_list_flag("--allowed-methods", "GET, POST") == ("GET", "POST")
    with pytest.raises(ValueError, match="--allowed-headers"):
        parse_list_flag("--allowed-headers", "[1]")
