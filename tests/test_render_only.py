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
    ids = client.tokenize("héllo 世界 🙂")
    assert client.detokenize(ids) == "héllo 世界 🙂"
    chat = client.render_chat([{"role": "user", "content": "hi"}])
    assert chat["prompt"].endswith("<|im_start|>assistant\n")
    assert chat["prompt_token_ids"].count(client.tokenizer.bos_token_id) == 1
    rendered = client.render({"prompt_token_ids": [5, 6, 7]})
    assert rendered.token_ids == [5, 6, 7]
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        client.render({"prompt_token_ids": [10**9]})
    with pytest.raises(NotImplementedError, match="no model"):
        client.generate("hi", legato.SamplingParams(), "r")
    with pytest.raises(NotImplementedError, match="no model"):
        await client.sleep()
    await client.check_health()
    assert client.is_running and not client.errored
    client.shutdown()
    assert client.is_stopped
