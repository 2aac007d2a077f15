"""LoRA adapters and embeddings over HTTP (and adapters over the WebSocket), on the toy model.

Adapters are served as model names (``--lora-modules``, or loaded at run time
behind ``allow_runtime_lora_updating``); greedy tokens are checked against
peft on the same adapter, embeddings against transformers' hidden states.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import trio_websocket

from legato import LoRARequest
from legato.engine import AsyncEngine, open_engine
from legato.server.lora_routes import parse_lora_modules

from .conftest import ENGINE_ARGS, MODEL, serving

LORA_ARGS: dict[str, Any] = dict(ENGINE_ARGS, enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = [5, 300, 71, 1200, 9, 44, 803, 17, 650, 1000, 23]
N = 8


@pytest.fixture(scope="module")
def adapters(make_toy_adapter: Any) -> dict[str, Any]:
    return {
        "a": make_toy_adapter(r=4, targets=("q_proj", "v_proj"), seed=1),
        "b": make_toy_adapter(r=8, seed=2, use_rslora=True),
        "too_big": make_toy_adapter(r=16, targets=("q_proj",), seed=3),
    }


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), executor="inproc", **LORA_ARGS) as eng:
        yield eng


async def complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post(
        "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
              "ignore_eos": True},
    )  # fmt: skip


def same_text(engine: AsyncEngine, text: str, tokens: list[int]) -> bool:
    """``text`` is what ``tokens`` decode to (a trailing incomplete UTF-8 character
    the incremental detokenizer holds back aside)."""
    expected = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return bool(text) and text.rstrip("\ufffd") == expected.rstrip("\ufffd")


def parse(modules: list[str]) -> tuple[LoRARequest, ...]:
    return parse_lora_modules(modules)


async def test_adapters_as_model_names(
    engine: AsyncEngine, adapters: dict[str, Any], tmp_path: Path
) -> None:
    modules = parse([f"a={adapters['a'].path}"])
    root = os.path.commonpath([str(tmp_path), *(str(a.path) for a in adapters.values())])
    async with serving(
        engine, lora_modules=modules, allow_runtime_lora_updating=True, lora_root=root
    ) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            models = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("a", MODEL)]
            assert models[1]["root"] == "a"  # never a path of the host

            for model, expected in [
                ("a", adapters["a"].greedy(PROMPT, N)),
                (MODEL, adapters["b"].base_greedy(PROMPT, N)),
            ]:
                response = await complete(client, model)
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["model"] == model
                assert same_text(engine, body["choices"][0]["text"], expected)

            response = await complete(client, "b")
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "model_not_found"

            # Run-time loading: bad adapters are 400s naming the field; the server lives.
            load = "/v1/load_lora_adapter"
            for body, param in [
                ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "lora_path"),
                ({"lora_name": "x", "lora_path": str(adapters["too_big"].path)}, "max_lora_rank"),
                ({"lora_name": "a", "lora_path": str(adapters["b"].path)}, "lora_name"),
                ({"lora_name": "x"}, "lora_path"),
                ({"lora_name": "x", "lora_path": "/etc"}, "lora_path"),  # outside --lora-root
                ({"lora_name": "x", "lora_path": "../../../../etc"}, "lora_path"),
            ]:
                response = await client.post(load, json=body)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == param
            # F11: one answer whatever the path is (a file, a directory, nothing): no oracle.
            (tmp_path / "plain_dir").mkdir()
            (tmp_path / "plain_file").write_text("x")
            answers = set()
            for probe in ("missing", "plain_dir", "plain_file"):
                body = {"lora_name": "x", "lora_path": str(tmp_path / probe)}
                response = await client.post(load, json=body)
                assert response.status_code == 400 and str(tmp_path) not in response.text
                answers.add(response.json()["error"]["message"])
            assert len(answers) == 1, answers
            response = await client.post(
                load, json={"lora_name": "b", "lora_path": str(adapters["b"].path)}
            )
            assert response.status_code == 200, response.text
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [
                MODEL, "a", "b",
            ]  # fmt: skip
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "b", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2},
            )  # fmt: skip
            assert response.status_code == 200 and response.json()["model"] == "b"
            response = await complete(client, "b")
            assert same_text(
                engine, response.json()["choices"][0]["text"], adapters["b"].greedy(PROMPT, N)
            )

            # The WebSocket selects an adapter by model name too.
            async with trio_websocket.open_websocket_url(server.ws_url) as ws:
                await ws.send_message(json.dumps({
                    "type": "generate", "request_id": "w", "model": "a",
                    "prompt_token_ids": PROMPT,
                    "params": {"max_tokens": N, "temperature": 0, "ignore_eos": True},
                }))  # fmt: skip
                tokens: list[int] = []
                while True:
                    frame = json.loads(await ws.get_message())
                    assert frame["type"] == "output", frame
                    tokens += frame["token_ids"]
                    if frame["finished"]:
                        break
                assert tokens == adapters["a"].greedy(PROMPT, N)

            unload = "/v1/unload_lora_adapter"
            assert (await client.post(unload, json={"lora_name": "b"})).status_code == 200
            assert (await client.post(unload, json={"lora_name": "b"})).status_code == 404
            assert (await complete(client, "b")).status_code == 404
            assert await engine.list_loras() == {1}
            assert [lora.lora_name for lora in engine.loaded_loras()] == ["a"]


async def test_runtime_loading_is_off_by_default(
    engine: AsyncEngine, adapters: dict[str, Any]
) -> None:
    async with serving(engine) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            response = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "a", "lora_path": str(adapters["a"].path)},
            )
            assert response.status_code == 404
            assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]
    assert await engine.list_loras() == set()


def test_lora_modules_parsing() -> None:
    assert parse(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == (
        LoRARequest("a", 1, "/x"),
        LoRARequest("b", 2, "/y", "m"),
    )
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"], ['{"name": "b"}']):
        with pytest.raises(ValueError, match="lora_modules: "):
            parse(bad)


# ---------------------------------------------------------------- embeddings


def hf_last_hidden(toy_model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
            vectors.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1))
    return vectors


async def test_embeddings_endpoint(engine: AsyncEngine, toy_model_dir: Path) -> None:
    """OpenAI's client (base64 by default) and plain floats: vectors within 1e-5 of
    transformers' normalised last hidden state; bad fields are 400s naming them."""
    text = "Once upon a time"
    text_ids = engine.tokenizer.encode(text)
    expected = hf_last_hidden(toy_model_dir, [text_ids, PROMPT])
    async with serving(engine) as server:
        async with openai.AsyncOpenAI(
            base_url=server.http_url + "/v1", api_key="unused", max_retries=0
        ) as oai:
            result = await oai.embeddings.create(model=MODEL, input=[text, text])
            assert len(result.data) == 2 and result.usage.prompt_tokens == 2 * len(text_ids)
            for item in result.data:
                got = torch.tensor(item.embedding)
                torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            response = await client.post(
                "/v1/embeddings", json={"input": [PROMPT], "encoding_format": "float"}
            )
            assert response.status_code == 200, response.text
            got = torch.tensor(response.json()["data"][0]["embedding"])
            torch.testing.assert_close(got, expected[1], atol=1e-5, rtol=0)
            for body, param in [
                ({"input": text, "dimensions": 8}, "dimensions"),
                ({"input": [[]]}, "input"),
                ({"input": [[5, 10**9]]}, "input"),
                ({"input": text, "encoding_format": "hex"}, "encoding_format"),
            ]:
                response = await client.post("/v1/embeddings", json=body)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == param
            response = await client.post("/v1/embeddings", json={"input": text, "model": "x"})
            assert response.status_code == 404
    await engine.check_health()
