"""RenderOnlyClient: rendering without a model."""

from __future__ import annotations

from typing import Any

import pytest

import legato
from legato import RenderOnlyClient
from legato.protocol.errors import ValidationError


async def test_renders_tokenizes_and_refuses_inference(toy_model_dir: Any) -> None:
    client = RenderOnlyClient(str(toy_model_dir))
    assert await client.get_supported_tasks() == ("render",)
    ids = await client.tokenize("héllo 世界 🙂")
    assert await client.detokenize(ids) == "héllo 世界 🙂"
    assert client.token_text(ids[0]) == await client.detokenize(ids[:1], skip_special_tokens=False)
    chat = client.render_chat([{"role": "user", "content": "hi"}])
    assert chat["prompt"].endswith("<|im_start|>assistant\n")
    assert chat["prompt_token_ids"].count(client.tokenizer.bos_token_id) == 1
    rendered = client.render({"prompt_token_ids": [5, 6, 7]})
    assert rendered.token_ids == [5, 6, 7]
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        client.render({"prompt_token_ids": [10**9]})
    with pytest.raises(NotImplementedError, match="no model"):
        client.generate("hi", legato.SamplingParams(), "r")
    await client.check_health()
    assert client.is_running and not client.errored


async def test_a_null_object_as_vllms_launch_engine_client(toy_model_dir: Any) -> None:
    """Control calls do nothing and answer vLLM's constants; only inference raises."""
    client = RenderOnlyClient(str(toy_model_dir))
    await client.pause_generation(mode="keep")
    await client.resume_generation()
    await client.sleep(2)
    await client.wake_up(["weights"])
    await client.start_profile()
    await client.stop_profile()
    assert await client.reset_prefix_cache(reset_running_requests=True) is True
    assert await client.add_lora(legato.LoRARequest("a", 1, "/adapters/a")) is False
    await client.abort(["r1", "r2"], internal=True)
    assert not await client.is_paused() and not await client.is_sleeping()
    assert await client.get_tokenizer() is client.tokenizer
    assert await client.get_tokenizer(legato.LoRARequest("a", 1, "/a")) is client.tokenizer
    assert isinstance(client.dead_error, RuntimeError)
    assert str(client.dead_error) == "RenderOnlyClient does not support inference"
    client.shutdown(timeout=1.0)
    assert client.is_running and not client.is_stopped  # nothing to stop, as vLLM's


async def test_vllm_config_surface(toy_model_dir: Any) -> None:
    client = RenderOnlyClient(str(toy_model_dir), max_model_len=300)
    model_config = await client.get_model_config()
    assert model_config == client.model_config == (await client.get_vllm_config()).model_config
    assert (model_config.model, model_config.max_model_len) == (str(toy_model_dir), 300)
    assert (await client.get_decoding_config()).backend == "guidance"
    # vLLM's constructor: from a VllmConfig (here EngineArgs' view).
    args = legato.EngineArgs(model=str(toy_model_dir), max_model_len=200)
    again = RenderOnlyClient.from_vllm_config(args.create_engine_config())
    assert again.model_config.max_model_len == 200 == again.renderer.max_model_len
    assert await again.tokenize("hello") == await client.tokenize("hello")
    direct = RenderOnlyClient(args.create_engine_config())  # vLLM's __init__(vllm_config)
    assert direct.renderer.max_model_len == 200 and await direct.tokenize(
        "hi"
    ) == await client.tokenize("hi")


async def test_input_and_io_processors_as_vllms(toy_model_dir: Any) -> None:
    """``input_processor.process_inputs`` renders as the client does; ``io_processor`` is
    None, what vLLM's ``get_io_processor`` gives a model with no IO plugin."""
    client = RenderOnlyClient(str(toy_model_dir))
    request = client.input_processor.process_inputs("r", "hello", legato.SamplingParams())
    assert request.prompt_token_ids == await client.tokenize("hello")
    assert client.io_processor is None


async def test_large_inputs_tokenize_off_the_event_loop(toy_model_dir: Any) -> None:
    """A large text (or many ids) is tokenized in the worker thread with its own
    renderer, never on the event loop: the loop's renderer is made to refuse."""
    import threading

    client = RenderOnlyClient(str(toy_model_dir))
    text = "the quick brown fox jumps over the lazy dog. " * 2000  # 90k characters
    expected = client.renderer.encode(text)
    assert await client.tokenize(text) == expected  # makes the thread's own renderer
    loop_thread = threading.current_thread()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        assert threading.current_thread() is not loop_thread, "ran on the event loop"
        raise AssertionError("the event loop's renderer was used")

    client.renderer.encode = refuse  # type: ignore[method-assign]
    client.renderer.decode = refuse  # type: ignore[method-assign]
    ids = await client.tokenize(text)
    assert ids == expected
    assert await client.detokenize(ids) == text
