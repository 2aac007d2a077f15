"""LoRA adapters and embeddings through the engine's EngineClient facade, on the toy model.

References: peft (transformers + the same adapter) for greedy fp32 tokens,
transformers' final hidden states for the embeddings. The engine runs its
worker in a process (adapters cross it as plain fields).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from legato import LoRARequest, SamplingParams
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import EngineGenerateError, ValidationError
from legato.protocol.params import PoolingParams, RequestOutputKind

NEW_TOKENS = 12
ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=256,
    num_kv_blocks=200,
    disable_log_stats=True,
    dtype="float32",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
)
PROMPTS = [
    [5, 300, 71, 1200, 9, 44, 803, 17, 650, 1000, 23, 88, 400, 12, 90, 1500, 2000, 7],
    [40, 41, 42, 900, 901, 33],
    [1777, 3, 250, 251, 252, 253, 640, 641, 99, 100, 101, 102, 103],
]


def greedy() -> SamplingParams:
    return SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


@pytest.fixture(scope="module")
def adapters(make_toy_adapter: Any) -> dict[str, Any]:
    return {
        "a": make_toy_adapter(r=4, targets=("q_proj", "v_proj"), seed=1),
        "b": make_toy_adapter(r=8, seed=2, use_rslora=True),
    }


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), **ENGINE_ARGS) as eng:
        yield eng


async def run(engine: AsyncEngine, prompt: list[int], rid: str, lora: Any = None) -> Any:
    async with engine.generate(
        {"prompt_token_ids": prompt}, greedy(), rid, lora_request=lora
    ) as stream:
        async for out in stream:
            final = out
    return final


def peft_base(adapter: Any, prompt: list[int]) -> list[int]:
    with adapter.peft_model.disable_adapter():
        return list(adapter.greedy(prompt, NEW_TOKENS))


async def test_base_and_two_adapters_in_one_batch_match_peft(
    engine: AsyncEngine, adapters: dict[str, Any]
) -> None:
    """Base, adapter a (r4 q/v) and adapter b (r8 rsLoRA, all seven projections) run
    concurrently: each request's greedy tokens equal peft's for its adapter."""
    loras = {
        name: LoRARequest(name, i + 1, str(adapters[name].path)) for i, name in enumerate("ab")
    }
    assert await engine.add_lora(loras["a"]) is True
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        expected[f"base{i}"] = peft_base(adapters["a"], prompt)
        jobs.append((f"base{i}", prompt, None))
        for name in ("a", "b"):
            expected[f"{name}{i}"] = adapters[name].greedy(prompt, NEW_TOKENS)
            jobs.append((f"{name}{i}", prompt, loras[name]))
    for i in range(len(PROMPTS)):  # every adapter changes the output
        assert len({tuple(expected[f"{k}{i}"]) for k in ("base", "a", "b")}) == 3

    async def one(rid: str, prompt: list[int], lora: Any) -> None:
        got[rid] = (await run(engine, prompt, rid, lora)).outputs[0].token_ids

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(one, *job)
    assert got == expected
    assert await engine.list_loras() == {1, 2}  # b was loaded by its first request


async def test_prefix_cache_is_keyed_by_adapter(
    engine: AsyncEngine, adapters: dict[str, Any]
) -> None:
    """A prompt cached by the base model is not reused under an adapter (its KV differs),
    and one cached under the adapter is."""
    lora = LoRARequest("a", 1, str(adapters["a"].path))
    prompt = PROMPTS[0] * 3  # several full blocks
    base = await run(engine, prompt, "base")
    first = await run(engine, prompt, "a1", lora)
    assert first.num_cached_tokens == 0
    # As vLLM's, the output and each completion name the adapter they came through.
    assert base.lora_request is None and base.outputs[0].lora_request is None
    assert first.lora_request == lora and first.outputs[0].lora_request == lora
    assert first.outputs[0].token_ids == adapters["a"].greedy(prompt, NEW_TOKENS)
    second = await run(engine, prompt, "a2", lora)
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


async def test_bad_adapters_fail_that_call_only(
    engine: AsyncEngine, make_toy_adapter: Any, adapters: dict[str, Any], tmp_path: Path
) -> None:
    """A bad path, a rank above max_lora_rank, an unknown module: each add_lora or
    request fails with an error naming the field; the engine keeps serving."""
    too_big = make_toy_adapter(r=16, targets=("q_proj",), seed=3)
    on_lm_head = make_toy_adapter(r=4, targets=("q_proj", "lm_head"), seed=4)
    cases = [
        (LoRARequest("x", 7, str(tmp_path / "missing")), "lora_path", "is not a directory"),
        (LoRARequest("y", 8, str(too_big.path)), "max_lora_rank", "rank 16"),
        (LoRARequest("z", 9, str(on_lm_head.path)), "target_modules", "lm_head"),
    ]
    for lora, field, why in cases:
        with pytest.raises(ValidationError, match=why) as info:
            await engine.add_lora(lora)
        assert info.value.field == field
        with pytest.raises(ValidationError, match=why) as info:
            await run(engine, PROMPTS[1], "bad", lora)
        assert info.value.field == field
    with pytest.raises(ValidationError, match="lora_request: must be a LoRARequest"):
        await run(engine, PROMPTS[1], "bad", "a")
    # The same name under another id is refused; the engine still serves with adapters.
    good = LoRARequest("a", 1, str(adapters["a"].path))
    await engine.add_lora(good)
    with pytest.raises(ValidationError, match="lora_name: 'a' is already loaded"):
        await engine.add_lora(LoRARequest("a", 5, str(adapters["b"].path)))
    out = await run(engine, PROMPTS[1], "good", good)
    assert out.outputs[0].token_ids == adapters["a"].greedy(PROMPTS[1], NEW_TOKENS)
    assert await engine.list_loras() == {1}
    await engine.check_health()


async def test_add_remove_pin(engine: AsyncEngine, adapters: dict[str, Any]) -> None:
    a = LoRARequest("a", 1, str(adapters["a"].path))
    assert await engine.pin_lora(1) is False  # not loaded
    await engine.add_lora(a)
    assert await engine.pin_lora(1) is True
    assert engine.adapters.by_name("a") == a
    assert await engine.remove_lora(1) is True
    assert await engine.remove_lora(1) is False
    assert await engine.list_loras() == set()
    assert engine.adapters.by_name("a") is None


async def test_lora_needs_enable_lora(toy_model_dir: Path, adapters: dict[str, Any]) -> None:
    args = {**ENGINE_ARGS, "enable_lora": False}
    async with open_engine(str(toy_model_dir), **args) as engine:
        lora = LoRARequest("a", 1, str(adapters["a"].path))
        with pytest.raises(ValidationError, match="lora_request: .*enable_lora"):
            await engine.add_lora(lora)
        with pytest.raises(ValidationError, match="enable_lora"):
            await run(engine, PROMPTS[1], "r", lora)
        out = await run(engine, PROMPTS[1], "base")  # the engine serves on
        assert out.outputs[0].token_ids == adapters["a"].base_greedy(PROMPTS[1], NEW_TOKENS)


async def test_adapter_whose_files_vanish_fails_its_requests_alone(
    toy_model_dir: Path, adapters: dict[str, Any], tmp_path: Path
) -> None:
    """max_cpu_loras=1: loading b evicts a and c from host memory; then a's files are
    deleted and c's weights corrupted. A request through either fails alone with an
    error naming its adapter (generation and embeddings alike); the base model and b
    (= peft) go on beside them, and the engine stays healthy."""
    import shutil

    copies = {}
    for name, source in (("a", "a"), ("c", "a"), ("b", "b")):
        copies[name] = tmp_path / name
        shutil.copytree(adapters[source].path, copies[name])
    loras = {name: LoRARequest(name, i + 1, str(copies[name])) for i, name in enumerate("acb")}
    args = {**ENGINE_ARGS, "max_loras": 1, "max_cpu_loras": 1}
    async with open_engine(str(toy_model_dir), **args) as engine:
        for name in "acb":  # each one evicts the one before from host memory
            await engine.add_lora(loras[name])
        shutil.rmtree(copies["a"])
        (copies["c"] / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
        results: dict[str, Any] = {}

        async def one(rid: str, lora: LoRARequest | None, embedding: bool = False) -> None:
            try:
                if embedding:
                    results[rid] = await embed(engine, PROMPTS[2], rid, lora_request=lora)
                else:
                    results[rid] = await run(engine, PROMPTS[1], rid, lora)
            except EngineGenerateError as exc:
                results[rid] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", loras["a"])
            nursery.start_soon(one, "base", None)
            nursery.start_soon(one, "c", loras["c"])
            nursery.start_soon(one, "b", loras["b"])
            nursery.start_soon(one, "a-embed", loras["a"], True)
        for rid, name in (("a", "a"), ("c", "c"), ("a-embed", "a")):
            error = results[rid]
            assert isinstance(error, EngineGenerateError), error
            assert f"LoRA adapter {name!r}" in str(error) and "cannot be read again" in str(error)
        assert results["base"].outputs[0].token_ids == peft_base(adapters["a"], PROMPTS[1])
        expected_b = adapters["b"].greedy(PROMPTS[1], NEW_TOKENS)
        assert results["b"].outputs[0].token_ids == expected_b
        assert not engine.errored
        await engine.check_health()
        assert (await run(engine, PROMPTS[1], "b2", loras["b"])).outputs[0].token_ids == expected_b


# ---------------------------------------------------------------- embeddings


def hf_embedding(toy_model_dir: Path, prompt: list[int], lora: Any = None) -> torch.Tensor:
    """transformers' (or peft's) final hidden state of the last token, L2-normalised."""
    from transformers import AutoModelForCausalLM

    model = lora.peft_model if lora is not None else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    return torch.nn.functional.normalize(hidden[0, -1], dim=-1)


async def embed(engine: AsyncEngine, prompt: list[int], rid: str, **kw: Any) -> Any:
    outs = [
        out async for out in engine.encode({"prompt_token_ids": prompt}, PoolingParams(), rid, **kw)
    ]
    assert len(outs) == 1 and outs[0].finished
    return outs[0]


async def test_embeddings_match_transformers_beside_generation(
    engine: AsyncEngine, toy_model_dir: Path, adapters: dict[str, Any]
) -> None:
    """encode() while generation runs: last-token pooling, normalised, within 1e-5 of
    transformers' hidden states (and of peft's through an adapter)."""
    assert await engine.get_supported_tasks() == ("generate", "embed")
    vectors: dict[str, Any] = {}
    lora = LoRARequest("b", 2, str(adapters["b"].path))

    async def one_embed(i: int) -> None:
        vectors[f"e{i}"] = await embed(engine, PROMPTS[i], f"e{i}")

    async def generation() -> None:
        vectors["gen"] = await run(engine, PROMPTS[0], "gen")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generation)
        for i in range(len(PROMPTS)):
            nursery.start_soon(one_embed, i)
    for i, prompt in enumerate(PROMPTS):
        out = vectors[f"e{i}"]
        assert out.request_id == f"e{i}" and out.prompt_token_ids == prompt
        got = out.outputs.data
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32  # as vLLM's
        assert out.outputs.embedding == got.tolist()
        torch.testing.assert_close(got, hf_embedding(toy_model_dir, prompt), atol=1e-5, rtol=0)
    assert vectors["gen"].outputs[0].token_ids == peft_base(adapters["a"], PROMPTS[0])
    through = await embed(engine, PROMPTS[2], "lora", lora_request=lora)
    torch.testing.assert_close(
        through.outputs.data,
        hf_embedding(toy_model_dir, PROMPTS[2], adapters["b"]),
        atol=1e-5,
        rtol=0,
    )
    with pytest.raises(ValidationError, match="dimensions: this model gives 256-dim"):
        [o async for o in engine.encode("hi", PoolingParams(dimensions=8), "dims")]
    with pytest.raises(ValidationError, match="task: "):
        [o async for o in engine.encode("hi", PoolingParams(task="classify"), "task")]
    await engine.check_health()


async def test_vllm_lora_requests_info_names_the_running_adapter(
    toy_model_dir: Path, adapters: dict[str, Any]
) -> None:
    """``vllm:lora_requests_info`` (with vLLM metric names) has a series naming the
    adapter a request ran through."""
    lora = LoRARequest("a", 1, str(adapters["a"].path))
    async with open_engine(str(toy_model_dir), vllm_metric_names=True, **ENGINE_ARGS) as engine:
        await run(engine, PROMPTS[0], "r", lora)
        metrics = engine.stats.exposition().decode()
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a"' in metrics
    assert "vllm:cache_config_info{" in metrics
