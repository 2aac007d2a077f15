"""A request's own chat template (F1): refused unless the operator trusts request
templates; then rendered in a child process with CPU, memory and time limits, so a
hostile template fails its request and the server keeps answering."""

from __future__ import annotations

import httpx
import trio

from legato.engine import AsyncEngine

from .conftest import MODEL, serving

CHAT = [{"role": "user", "content": "hello there"}]
GREEDY = {"model": MODEL, "max_tokens": 2, "temperature": 0.0}
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
NESTED = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
HUNGRY = "{{ 'x' * 10000000000 }}"


async def test_a_request_template_is_refused_by_default(engine: AsyncEngine) -> None:
    async with serving(engine) as server, httpx.AsyncClient(base_url=server.http_url) as client:
        body = {**GREEDY, "messages": CHAT, "chat_template": PLAIN}
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (
            error["param"] == "chat_template"
            and "--trust-request-chat-template" in error["message"]
        )


async def test_a_trusted_request_template_renders_in_a_limited_child(engine: AsyncEngine) -> None:
    async with (
        serving(engine, trust_request_chat_template=True) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=60) as client,
    ):
        body = {**GREEDY, "messages": CHAT, "chat_template": PLAIN}
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        expected = engine.renderer.encode("<user>hello there<assistant>", add_special_tokens=False)
        assert answer.json()["usage"]["prompt_tokens"] == len(expected)
        with trio.fail_after(30):  # in this process, NESTED would never end
            for template, why in ((NESTED, "time"), (HUNGRY, "memory")):
                body = {**GREEDY, "messages": CHAT, "chat_template": template}
                refused = await client.post("/v1/chat/completions", json=body)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["param"] == "chat_template"
                assert why in refused.json()["error"]["message"], refused.text
            broken = {**GREEDY, "messages": CHAT, "chat_template": "{{ raise_exception('no') }}"}
            refused = await client.post("/v1/chat/completions", json=broken)
            assert refused.status_code == 400 and "no" in refused.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200
