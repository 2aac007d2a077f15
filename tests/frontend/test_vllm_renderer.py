"""vLLM's ``BaseRenderer`` calls on legato's renderer: what ``engine.renderer`` gives
code written for vLLM (``get_tokenizer``, ``render_cmpl``, ``render_chat`` with
``ChatParams``), and that its engine prompts generate as the plain prompts do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from legato import ChatParams, RenderOnlyClient, SamplingParams, TokenizeParams
from legato.engine import open_engine
from legato.frontend.renderer import Renderer
from legato.protocol.errors import PromptTooLongError, ValidationError

MESSAGES = [{"role": "user", "content": "Say hi"}]


@pytest.fixture
def renderer(toy_tokenizer: Any) -> Renderer:
    return Renderer(
        toy_tokenizer, max_model_len=64, vocab_size=len(toy_tokenizer), eos_token_ids=[1]
    )


def test_render_cmpl_gives_vllms_engine_prompts(renderer: Renderer, toy_tokenizer: Any) -> None:
    assert renderer.get_tokenizer() is toy_tokenizer
    ids = renderer.encode("Once upon a time")
    text, tokens = renderer.render_cmpl([{"prompt": "Once upon a time"}, {"prompt_token_ids": ids}])
    assert text["type"] == tokens["type"] == "token"
    assert text["prompt_token_ids"] == tokens["prompt_token_ids"] == ids
    assert text["prompt"] == "Once upon a time" and "prompt" not in tokens
    assert isinstance(text["arrival_time"], float)
    params = TokenizeParams(max_total_tokens=64, truncate_prompt_tokens=2, add_special_tokens=False)
    (cut,) = renderer.render_cmpl([{"prompt": "Once upon a time"}], params)
    assert cut["prompt_token_ids"] == renderer.encode("Once upon a time", add_special_tokens=False)[-2:]
    with pytest.raises(PromptTooLongError, match="maximum input length of 3 tokens"):
        renderer.render_cmpl([{"prompt_token_ids": [5] * 4}], TokenizeParams(8, max_output_tokens=5))
    with pytest.raises(ValidationError, match="prompt_embeds"):
        renderer.render_cmpl([b"\x00"])
    with pytest.raises(ValueError, match="at least one prompt"):
        renderer.render_cmpl([])


def test_render_chat_takes_vllms_form_and_keeps_legatos(renderer: Renderer) -> None:
    want = renderer.render_chat_prompt(MESSAGES)
    conversations, prompts = renderer.render_chat([MESSAGES], ChatParams())
    assert conversations == [MESSAGES]
    assert prompts[0]["prompt_token_ids"] == want["prompt_token_ids"]
    assert prompts[0]["prompt"] == want["prompt"] == renderer.render_chat(MESSAGES)
    no_generation = ChatParams(chat_template_kwargs={"add_generation_prompt": False})
    _, (bare,) = renderer.render_chat([MESSAGES], no_generation)
    assert bare["prompt"] == renderer.render_chat(MESSAGES, add_generation_prompt=False)
    assert renderer.stat_mm_cache() is None and renderer.mm_processor_cache is None
    renderer.clear_mm_cache()


async def test_the_engines_renderer_feeds_generate(toy_model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    args: dict[str, Any] = dict(executor="inproc", max_model_len=128, num_kv_blocks=32)
    async with open_engine(str(toy_model_dir), **args) as engine:
        (prompt,) = engine.renderer.render_cmpl([{"prompt": "Once upon a time"}])
        via_renderer = [out async for out in engine.generate(prompt, greedy, "a")][-1]
        plain = [out async for out in engine.generate("Once upon a time", greedy, "b")][-1]
        assert via_renderer.outputs[0].token_ids == plain.outputs[0].token_ids
        assert via_renderer.prompt == "Once upon a time"
    client = RenderOnlyClient(str(toy_model_dir))
    (same,) = client.renderer.render_cmpl([{"prompt": "Once upon a time"}])
    assert same["prompt_token_ids"] == prompt["prompt_token_ids"]
