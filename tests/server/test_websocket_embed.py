"""``embed`` frames on the WebSocket: the vectors of ``POST /v1/embeddings`` for the same
body (and transformers' hidden states), adapters by model name, bad fields as error
frames naming them (only that request fails), and ``abort``.

A real server on loopback over an in-process engine on the toy model (fp32).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

from legato import LoRARequest
from legato.engine import AsyncEngine, open_engine
from legato.server import Server

from .conftest import ENGINE_ARGS, MODEL, metric
from .test_websocket import collect, connect, receive, send

ARGS: dict[str, Any] = dict(
    ENGINE_ARGS, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8
)
PROMPT = [5, 300, 71, 1200, 9, 44, 803, 17, 650, 1000, 23]
TEXT = "Once upon a time"


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    """The toy model in fp32 with LoRA on; conftest's ``server`` runs over it."""
    async with open_engine(str(toy_model_dir), executor="inproc", **ARGS) as eng:
        yield eng


def embed(rid: str, **body: Any) -> dict[str, Any]:
    return {"type": "embed", "request_id": rid, **body}


def vectors(frame: dict[str, Any]) -> list[torch.Tensor]:
    """An ``embedding`` frame's (or a response body's) vectors, base64 decoded."""
    out = []
    for item in frame["data"]:
        value = item["embedding"]
        if isinstance(value, str):
            raw = base64.b64decode(value)
            value = struct.unpack(f"<{len(raw) // 4}f", raw)
        out.append(torch.tensor(value))
    return out


def last_hidden(toy_model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]


async def test_embed_frames_match_the_http_endpoint(
    server: Server, engine: AsyncEngine, toy_model_dir: Path, make_toy_adapter: Any
) -> None:
    """Text and token ids, float and base64, JSON and msgpack, normalize, an adapter
    by ``model``: each frame's vectors are the HTTP endpoint's for the same body,
    and the base model's are transformers' (normalised) within 1e-5."""
    adapter = make_toy_adapter(r=8, seed=2, use_rslora=True)
    await engine.add_lora(LoRARequest("b", 1, str(adapter.path)))
    bodies = {
        "text": {"input": [TEXT, TEXT]},
        "ids": {"input": [PROMPT], "encoding_format": "base64"},
        "raw": {"input": PROMPT, "normalize": False},
        "lora": {"input": [PROMPT], "model": "b"},
    }
    async with connect(server) as ws, httpx.AsyncClient(base_url=server.http_url) as client:
        for i, (rid, body) in enumerate(bodies.items()):
            await send(ws, embed(rid, **body), binary=i % 2 == 1)
        frames = await collect(ws, set(bodies))
        for rid, body in bodies.items():
            (frame,) = frames[rid]
            assert frame["type"] == "embedding", frame
            assert frame["finish_reason"] == "stop"
            assert frame["model"] == body.get("model", MODEL)
            response = await client.post("/v1/embeddings", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert frame["usage"]["prompt_tokens"] == response.json()["usage"]["prompt_tokens"]
            got, want = vectors(frame), vectors(response.json())
            assert len(got) == len(want) == len(body["input"]) if rid == "text" else 1
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    text_ids = engine.tokenizer.encode(TEXT)
    hidden = last_hidden(toy_model_dir, text_ids)
    torch.testing.assert_close(
        vectors(frames["text"][0])[1], torch.nn.functional.normalize(hidden, dim=-1),
        atol=1e-5, rtol=0,
    )  # fmt: skip
    raw = vectors(frames["raw"][0])[0]
    torch.testing.assert_close(raw, last_hidden(toy_model_dir, PROMPT), atol=1e-5, rtol=0)
    lora = vectors(frames["lora"][0])[0]
    assert not torch.allclose(lora, vectors(frames["ids"][0])[0], atol=1e-3)  # the adapter acts


async def test_bad_embed_frames_fail_alone(server: Server, engine: AsyncEngine) -> None:
    """Each bad field is an error frame naming it; a good request beside them is answered."""
    bad = {
        "empty": ({"input": [[]]}, "input", "invalid_request"),
        "vocab": ({"input": [[5, 10**9]]}, "input", "invalid_request"),
        "missing": ({}, "input", "invalid_request"),
        "dims": ({"input": TEXT, "dimensions": 8}, "dimensions", "invalid_request"),
        "fmt": ({"input": TEXT, "encoding_format": "hex"}, "encoding_format", "invalid_request"),
        "norm": ({"input": TEXT, "normalize": "yes"}, "normalize", "invalid_request"),
        "model": ({"input": TEXT, "model": "nope"}, "model", "model_not_found"),
    }
    async with connect(server) as ws:
        await send(ws, embed("", input=TEXT))
        frame, _ = await receive(ws)
        assert frame["type"] == "error" and frame["param"] == "request_id"
        for rid, (body, _, _) in bad.items():
            await send(ws, embed(rid, **body))
        await send(ws, embed("good", input=TEXT))
        frames = await collect(ws, {*bad, "good"})
    for rid, (_, param, code) in bad.items():
        (frame,) = frames[rid]
        assert (frame["type"], frame["code"], frame["param"]) == ("error", code, param), frame
        assert frame["message"].startswith(param) or code == "model_not_found"
    assert frames["good"][0]["type"] == "embedding" and len(frames["good"][0]["data"]) == 1
    await engine.check_health()


async def test_abort_ends_an_embed_request(
    server: Server, engine: AsyncEngine, gate_steps: Any
) -> None:
    """An ``abort`` while the request waits for its step: the answer has finish_reason
    "abort" and no vectors, the engine request is gone, the connection goes on."""
    gate = gate_steps(engine)
    gate.close()
    async with connect(server) as ws, httpx.AsyncClient(base_url=server.http_url) as client:
        await send(ws, embed("e", input=[PROMPT, PROMPT[:4]]))
        with trio.fail_after(10):
            await gate.wait_held()
        await send(ws, {"type": "abort", "request_id": "e"})
        frame, _ = await receive(ws)
        assert frame["type"] == "embedding" and frame["request_id"] == "e"
        assert frame["finish_reason"] == "abort" and frame["data"] == []
        assert engine.frontend.core.live == {}  # the engine streams were closed (their requests aborted)
        gate.open()
        with trio.fail_after(10):
            await engine.wait_until_idle()
        text = (await client.get("/metrics")).text
        assert metric(text, "legato:num_requests_running") == 0
        assert engine.num_kv_blocks_used == 0
        await send(ws, embed("e", input=TEXT))  # the id is free again
        frame, _ = await receive(ws)
        assert frame["type"] == "embedding" and frame["finish_reason"] == "stop"
