"""Offline embeddings: ``LLM.embed`` / ``LLM.encode`` and ``LLMEngine``'s pooling path
(``add_request`` with PoolingParams), against transformers' final hidden states
on the toy checkpoint in fp32 (within 1e-5): the last token, L2-normalised, by
default; the mean of every prompt token with ``pooling_type="MEAN"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from legato import SamplingParams
from legato.config import EngineConfig
from legato.llm import LLM, LLMEngine
from legato.protocol.errors import ValidationError
from legato.protocol.outputs import PoolingRequestOutput, RequestOutput
from legato.protocol.params import PoolingParams, RequestOutputKind

ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=256, num_kv_blocks=120, disable_log_stats=True, dtype="float32"
)
PROMPTS = [
    [5, 300, 71, 1200, 9, 44, 803, 17, 650, 1000, 23, 88, 400, 12, 90, 1500, 2000, 7],
    [40, 41, 42, 900, 901, 33],
    [1777, 3, 250, 251, 252, 253, 640, 641, 99, 100, 101, 102, 103],
]


@pytest.fixture(scope="module")
def hidden_states(toy_model_dir: Path) -> list[torch.Tensor]:
    """transformers' final hidden states (after the final norm) of each prompt, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0]
            for p in PROMPTS
        ]


def close(got: Any, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(got), want, atol=1e-5, rtol=0)


def test_llm_embed_and_encode_match_transformers(
    toy_model_dir: Path, hidden_states: list[torch.Tensor]
) -> None:
    """Default pooling: the last token's hidden state, L2-normalised; ``normalize=False``
    gives it as it is. Outputs in the prompts' order; a bad request raises its field."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as llm:
        embedded = llm.embed(prompts, use_tqdm=False)
        raw = llm.encode(prompts, PoolingParams(normalize=False), use_tqdm=False)
        with pytest.raises(ValidationError) as caught:
            llm.embed(prompts, PoolingParams(dimensions=8), use_tqdm=False)
        assert caught.value.field == "dimensions"
    for i, hidden in enumerate(hidden_states):
        assert embedded[i].prompt_token_ids == PROMPTS[i]
        assert embedded[i].outputs.embedding == embedded[i].outputs.data.tolist()
        close(embedded[i].outputs.data, torch.nn.functional.normalize(hidden[-1], dim=-1))
        close(raw[i].outputs.data, hidden[-1])


def test_llm_engine_pools_beside_generation_with_mean_pooling(
    toy_model_dir: Path, hidden_states: list[torch.Tensor]
) -> None:
    """LLMEngine.add_request with PoolingParams: step() yields one PoolingRequestOutput
    per embedding request (mean of every prompt token here), while a generation
    request in the same steps goes on to its end."""
    eng = LLMEngine(EngineConfig(model=str(toy_model_dir), pooling_type="MEAN", **ENGINE_ARGS))
    assert eng.get_supported_tasks() == ("generate", "embed")
    gen = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    eng.add_request("gen", {"prompt_token_ids": PROMPTS[0]}, gen)
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"e{i}", {"prompt_token_ids": prompt}, PoolingParams())
    eng.add_request("raw", {"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False))
    with pytest.raises(ValidationError) as caught:
        eng.add_request("bad", "x", PoolingParams(task="classify"))
    assert caught.value.field == "task"
    pooled: dict[str, PoolingRequestOutput] = {}
    generated: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if isinstance(out, PoolingRequestOutput):
                assert out.request_id not in pooled
                pooled[out.request_id] = out
            else:
                assert isinstance(out, RequestOutput) and out.request_id == "gen"
                generated += out.outputs[0].token_ids
    assert set(pooled) == {"e0", "e1", "e2", "raw"}
    for i, hidden in enumerate(hidden_states):
        assert pooled[f"e{i}"].prompt_token_ids == PROMPTS[i]
        mean = hidden.mean(dim=0)
        close(pooled[f"e{i}"].outputs.data, torch.nn.functional.normalize(mean, dim=-1))
    close(pooled["raw"].outputs.data, hidden_states[1].mean(dim=0))
    assert len(generated) == 6
    final = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    eng.add_request("again", {"prompt_token_ids": PROMPTS[0]}, final)
    alone: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert isinstance(out, RequestOutput)
            alone += out.outputs[0].token_ids
    assert alone == generated  # pooling beside it changed nothing
