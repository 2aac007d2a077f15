"""The chat page's routes: the page and its files, its config, --no-web-ui, paths outside its folder.

The page itself is tested in a real browser by ``tests/browser`` (``scripts/test-browser.sh``).
"""

from __future__ import annotations

import json
import re
from importlib import resources

import httpx
import pytest
import trio

from legato.cli import build_parser
from legato.engine import AsyncEngine
from legato.server import Server, ServerSettings

from .conftest import MODEL, serving


async def test_the_page_and_every_file_it_loads_are_served(
    server: Server, client: httpx.AsyncClient
) -> None:
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert (await client.get("/ui/index.html")).content == page.content
    assets = re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text)
    assert sorted(assets) == ["/ui/chat.css", "/ui/chat.js"]
    types = {"/ui/chat.css": "text/css", "/ui/chat.js": "text/javascript"}
    for path in assets:
        response = await client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == f"{types[path]}; charset=utf-8"
        assert response.content, path
    assert "https://" not in page.text + (await client.get("/ui/chat.js")).text  # no CDN

    config = await client.get("/ui/config.json")
    assert config.headers["content-type"] == "application/json"
    assert config.json() == {
        "model": MODEL,
        "ws_port": server.ws_port,  # the bound port, not the requested 0
        "ws_url": None,
        "api_key_required": False,
    }
    wrong = await client.post("/", content=b"x")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")


async def test_the_page_is_public_with_an_api_key_and_the_api_is_not(engine: AsyncEngine) -> None:
    async with (
        serving(engine, api_key="k", web_ui_ws_url="wss://chat.example:9443/ws") as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
    ):
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/ui/chat.js")).status_code == 200
        config = (await client.get("/ui/config.json")).json()
        assert config["api_key_required"] is True
        assert config["ws_url"] == "wss://chat.example:9443/ws"
        assert "k" not in json.dumps(config).replace('"api_key_required"', "")  # never the key
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/ui/missing.js")).status_code == 401  # not a page file
        authorized = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert authorized.status_code == 200


async def test_no_web_ui_serves_no_page(engine: AsyncEngine) -> None:
    async with (
        serving(engine, web_ui=False) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
    ):
        for path in ("/", "/ui/index.html", "/ui/chat.js", "/ui/config.json"):
            response = await client.get(path)
            assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")
        assert (await client.get("/health")).status_code == 200


async def raw_get(server: Server, target: str) -> tuple[int, bytes]:
    """GET ``target`` exactly as written (httpx would resolve dot segments); status and body."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.http_port)
    async with stream:
        request = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        await stream.send_all(request.encode())
        data = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


TRAVERSALS = [
    "/ui/../http.py",
    "/ui/../../server/http.py",
    "/ui/%2e%2e/http.py",
    "/ui/%2E%2E%2Fhttp.py",
    "/ui/..%2fhttp.py",
    "/ui/..%5chttp.py",
    "/ui/..\\http.py",
    "/ui/%252e%252e%252fhttp.py",
    "/ui/chat.js/../../http.py",
    "/ui/static/../web_ui.py",
    "/ui/./chat.js/..%2f..%2fapp.py",
    "/../pyproject.toml",
    "/%2e%2e/%2e%2e/pyproject.toml",
    "/ui//etc/passwd",
    "/ui/%2fetc%2fpasswd",
    "/ui/chat.js%00.py",
    "/ui/",
    "/ui",
    "//ui/chat.js",
]


async def test_no_path_leaves_the_page_folder(server: Server) -> None:
    package = resources.files("legato.server")
    assert (package / "http.py").is_file() and (package / "static" / "chat.js").is_file()
    status, body = await raw_get(server, "/ui/chat.js")
    assert status == 200 and b"use strict" in body  # the probe itself works
    for target in TRAVERSALS:
        status, body = await raw_get(server, target)
        assert status in (400, 404), (target, status, body[:200])
        if status == 404:
            assert json.loads(body)["error"]["code"] == "not_found", target
        assert b"import" not in body and b"root:" not in body, target


def test_web_ui_flags_and_settings() -> None:
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.web_ui, defaults.web_ui_ws_url) == (True, None)
    args = build_parser().parse_args(["serve", "--no-web-ui", "--web-ui-ws-url", "ws://h:1/"])
    assert (args.web_ui, args.web_ui_ws_url) == (False, "ws://h:1/")
    assert ServerSettings().web_ui is True
    with pytest.raises(ValueError, match="web_ui_ws_url"):
        ServerSettings(web_ui_ws_url="http://h:1/")
