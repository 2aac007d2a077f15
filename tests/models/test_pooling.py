"""Pooling in the model runner against transformers' final hidden states (fp32, 1e-5).

LAST (the default, as vLLM's embedding runner for Llama-family models), MEAN
and CLS pooling, L2-normalised or not, with chunked prefill; pooling requests
batched with generation; a LoRA adapter's embeddings against peft's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from legato.protocol.params import PoolingParams

ATOL = 1e-5


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in lengths]


def _hidden(model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' final (normed) hidden states ``[T, H]`` for one prompt."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hidden: torch.Tensor = out.hidden_states[-1][0]
    return hidden


def _expected(hidden: torch.Tensor, pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
    return F.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_pooling_matches_transformers(
    checkpoint: Any,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    pooling: str,
    chunk: int | None,
) -> None:
    prompts = _prompts([1, 6, 23, 40])
    sched = mini_scheduler(make_runner(checkpoint, pooling_type=pooling), chunk=chunk)
    for i, prompt in enumerate(prompts):
        sched.add(f"e{i}", prompt, pooling=PoolingParams(normalize=i != 1))
    sched.run()
    for i, prompt in enumerate(prompts):
        got = torch.tensor(sched.done[f"e{i}"].pooled)
        want = _expected(_hidden(checkpoint.hf_model, prompt), pooling, normalize=i != 1)
        assert got.shape == (checkpoint.hf_model.config.hidden_size,)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        if i != 1:
            assert abs(got.norm().item() - 1.0) < 1e-5


def test_pooling_and_generation_share_a_batch(
    llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any, hf_greedy: Any
) -> None:
    """Embedding requests ride along with decoding ones; neither disturbs the other."""
    prompts = _prompts([12, 30, 5, 17], seed=1)
    sched = mini_scheduler(make_runner(llama), chunk=8)
    sched.add("g0", prompts[0], max_tokens=20)
    sched.step()
    sched.step()  # g0 is decoding when the embeddings arrive
    sched.add("e1", prompts[1], pooling=PoolingParams())
    sched.add("g2", prompts[2], max_tokens=20)
    sched.add("e3", prompts[3], pooling=PoolingParams(dimensions=48))
    outputs = sched.run()
    for rid in ("g0", "g2"):
        prompt = prompts[int(rid[1])]
        assert outputs[rid] == hf_greedy(llama, prompt, 20)[0]
    got = torch.tensor(sched.done["e1"].pooled)
    torch.testing.assert_close(
        got, _expected(_hidden(llama.hf_model, prompts[1]), "LAST"), rtol=0, atol=ATOL
    )
    truncated = torch.tensor(sched.done["e3"].pooled)
    want = F.normalize(_hidden(llama.hf_model, prompts[3])[-1][:48], dim=-1)
    assert truncated.shape == (48,)
    torch.testing.assert_close(truncated, want, rtol=0, atol=ATOL)
    assert outputs["e1"] == [] and outputs["e3"] == []  # nothing sampled for embeddings


def test_last_pooling_after_a_prefix_cache_hit(
    llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    donor, tail = _prompts([37, 9], seed=2)
    prompt = donor[:32] + tail
    sched = mini_scheduler(make_runner(llama))
    sched.add("donor", donor, max_tokens=2)
    sched.run()
    sched.add("hit", prompt, prefix_of="donor", prefix_blocks=2, pooling=PoolingParams())
    sched.run()
    got = torch.tensor(sched.done["hit"].pooled)
    torch.testing.assert_close(
        got, _expected(_hidden(llama.hf_model, prompt), "LAST"), rtol=0, atol=ATOL
    )


def test_mean_pooling_refuses_a_prefix_cache_start(
    llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    donor = _prompts([40], seed=3)[0]
    sched = mini_scheduler(make_runner(llama, pooling_type="MEAN"))
    sched.add("donor", donor, max_tokens=1)
    sched.run()
    sched.add("hit", donor[:36], prefix_of="donor", prefix_blocks=2, pooling=PoolingParams())
    with pytest.raises(ValueError, match="MEAN pooling needs every prompt token"):
        sched.step()


def test_embeddings_through_a_lora_adapter(
    llama: Any,
    make_adapter: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
) -> None:
    adapter = make_adapter(llama, r=8, seed=4)
    prompts = _prompts([11, 26], seed=4)
    sched = mini_scheduler(make_runner(llama, enable_lora=True, max_lora_rank=8), chunk=10)
    sched.add("base", prompts[0], pooling=PoolingParams())
    sched.add("lora", prompts[1], pooling=PoolingParams(), lora=adapter.request("a", 1))
    sched.run()
    base = torch.tensor(sched.done["base"].pooled)
    torch.testing.assert_close(
        base, _expected(_hidden(llama.hf_model, prompts[0]), "LAST"), rtol=0, atol=ATOL
    )
    tuned = torch.tensor(sched.done["lora"].pooled)
    want = _expected(_hidden(adapter.peft_model, prompts[1]), "LAST")
    torch.testing.assert_close(tuned, want, rtol=0, atol=ATOL)
    plain = _expected(_hidden(llama.hf_model, prompts[1]), "LAST")
    assert not torch.allclose(tuned, plain, atol=1e-3)
