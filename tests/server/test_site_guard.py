"""No web page may drive the server (issue 26: F6, F7, F8, F13): WebSocket Origin and
Host allowlists, CORS off by default, JSON only as application/json, and a chat page that
connects only to its own server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from trio_websocket import HandshakeError, open_websocket_url

from legato.engine import AsyncEngine
from legato.server import Server
from legato.server.cors import CORSPolicy
from legato.server.site_guard import SiteGuard
from legato.server.state import ServerSettings

from .conftest import MODEL, serving

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


async def _ws_status(server: Server, headers: list[tuple[str, str]]) -> int:
    """101 if the handshake is accepted, else the status of the refusal."""
    try:
        async with open_websocket_url(server.ws_url + "/", extra_headers=headers) as ws:
            await ws.aclose()
            return 101
    except HandshakeError as exc:
        return int(getattr(exc, "status_code", 0))


async def _raw_ws_status(port: int, host: str) -> int:
    """The status of a WebSocket handshake sent with ``Host: host`` (a client library
    would send the URL's host)."""
    handshake = (
        f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(handshake.encode())
            answer = b""
            while b"\r\n" not in answer:
                chunk = await stream.receive_some()
                if not chunk:
                    break
                answer += chunk
    return int(answer.split(b" ", 2)[1])


async def test_websocket_origins_own_page_and_allowed_only(engine: AsyncEngine) -> None:
    async with serving(engine, cors=CORSPolicy(allowed_origins=("https://app.example",))) as srv:
        own = f"http://127.0.0.1:{srv.http_port}"
        for origin, expected in [
            (None, 101),  # not a browser
            (own, 101),
            (f"http://localhost:{srv.http_port}", 101),
            ("https://app.example", 101),  # --allowed-origins
            ("http://evil.example", 403),
            (f"http://evil.example:{srv.http_port}", 403),
            ("http://127.0.0.1:9", 403),  # another local port is another site
            ("null", 403),  # sandboxed frames, file: pages
        ]:
            headers = [] if origin is None else [("Origin", origin)]
            with trio.fail_after(30):
                assert await _ws_status(srv, headers) == expected, origin


async def test_host_allowlist_on_both_ports(engine: AsyncEngine) -> None:
    async with (
        serving(engine, allowed_hosts=("llm.internal",)) as srv,
        httpx.AsyncClient(base_url=srv.http_url, timeout=30) as client,
    ):
        for host, expected in [
            (f"127.0.0.1:{srv.http_port}", 200),
            ("localhost", 200),
            (f"[::1]:{srv.http_port}", 200),
            ("llm.internal:8000", 200),  # --allowed-hosts
            ("rebind.evil.example:8000", 403),  # DNS rebinding
            ("10.1.2.3", 403),  # bound to loopback: only its names
        ]:
            answer = await client.get("/v1/models", headers={"host": host})
            assert answer.status_code == expected, (host, answer.text)
            if expected == 403:
                assert answer.json()["error"]["code"] == "host_not_allowed"
            status = await _raw_ws_status(srv.ws_port, host)
            assert status == (101 if expected == 200 else 403), host


def test_a_wildcard_bind_accepts_address_literals_but_no_other_name() -> None:
    guard = SiteGuard("0.0.0.0", 8000)
    assert guard.host_allowed("192.168.1.7:8000") and guard.host_allowed("[fe80::1]")
    assert not guard.host_allowed("rebind.evil.example") and not guard.host_allowed("a b")
    assert SiteGuard("10.0.0.2", 8000).host_allowed("10.0.0.2:8000")
    assert SiteGuard(allowed_hosts=("*",)).host_allowed("anything.example")


async def test_cors_is_off_by_default_and_json_needs_its_content_type(
    engine: AsyncEngine,
) -> None:
    async with (
        serving(engine) as srv,
        httpx.AsyncClient(base_url=srv.http_url, timeout=30) as client,
    ):
        preflight = await client.options(
            "/v1/completions",
            headers={
                "origin": "http://evil.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        assert preflight.status_code == 400
        assert "access-control-allow-origin" not in preflight.headers
        # A "simple" cross-site request (no preflight) is refused before anything runs.
        blind = await client.post(
            "/v1/completions",
            content=httpx.Request("POST", "/", json=BODY).content,
            headers={"origin": "http://evil.example", "content-type": "text/plain"},
        )
        assert blind.status_code == 415, blind.text
        assert blind.json()["error"]["code"] == "unsupported_media_type"
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers


def test_warnings_name_what_is_left_open(caplog: Any) -> None:
    open_settings = ServerSettings(host="0.0.0.0", cors=CORSPolicy(allowed_origins=("*",)))
    warnings = open_settings.security_warnings()
    assert any("0.0.0.0 without --api-key" in w for w in warnings)
    assert any("CORS allows any origin" in w for w in warnings)
    assert ServerSettings().security_warnings() == []
    assert ServerSettings(host="0.0.0.0", api_key="k").security_warnings() == []


@pytest.mark.parametrize("ws_url", [None, "wss://chat.example/ws"])
async def test_the_chat_page_connects_only_to_its_own_server(
    engine: AsyncEngine, ws_url: str | None
) -> None:
    """F13: no ``?ws=`` from the address bar, and the CSP lets the page open no other socket."""
    from importlib import resources

    script = (resources.files("legato.server") / "static" / "chat.js").read_text()
    assert 'get("ws")' not in script and "location.search" not in script
    async with (
        serving(engine, web_ui_ws_url=ws_url) as srv,
        httpx.AsyncClient(base_url=srv.http_url, timeout=30) as client,
    ):
        page = await client.get("/?ws=wss://attacker.example/")
        csp = page.headers["content-security-policy"]
        connect = next(p for p in csp.split(";") if p.strip().startswith("connect-src"))
        expected = ws_url.rsplit("/", 1)[0] if ws_url else f"ws://127.0.0.1:{srv.ws_port}"
        assert expected in connect and "attacker" not in connect
        assert " ws: " not in connect + " " and " wss: " not in connect + " "
