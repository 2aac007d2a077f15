"""The fused greedy head (legato.models.greedy_head, native/lm_head.h): a one-row greedy decode
step's last norm, LM head and argmax in one native call, against the three ops it replaces and
against plain torch (``F.linear`` on the dequantized head, then ``argmax``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from legato.config import EngineConfig
from legato.models import cpu_kernels
from legato.models.greedy_head import GreedyHead
from legato.models.quantized import QuantizedLinear, from_gguf
from legato.models.runner import ModelRunner
from legato.models.step_metadata import build_metadata
from legato.protocol.params import SamplingParams
from legato.testing.gguf_blocks import random_blocks, requantize_linears


@pytest.fixture
def vnni_two_threads() -> Iterator[None]:
    """The VNNI path (the fused head's only one) with two threads: two shares of the head."""
    if not cpu_kernels.available() or cpu_kernels.quantized_isa() != "avx512_vnni":
        pytest.skip("the fused greedy head runs on the AVX-512 VNNI path only")
    torch.set_num_threads(2)  # the autouse fixture restores it
    yield


def _meta(runner: ModelRunner, count: int, start: int) -> Any:
    table = np.arange(4, dtype=np.int32).reshape(1, -1)
    meta, _, _ = build_metadata(
        np.array([start], dtype=np.int64), np.array([count], dtype=np.int64), table,
        runner.block_size, runner.device,
    )  # fmt: skip
    return meta


@pytest.mark.parametrize("kind", [None, "Q4_1"])
def test_fused_head_equals_norm_head_and_argmax_on_real_rows(
    smollm2_gguf: Path, vnni_two_threads: None, kind: str | None
) -> None:
    """Decode steps of the default model (its Q8_0 head; re-quantized, a Q4_1 one): the fused
    call gives the plain path's hidden row and its logits bit for bit, the native argmax of
    them, and the argmax of F.linear on the dequantized head (to int8 rounding)."""
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=8, max_num_seqs=2,
        gguf_activations="int8",
    )  # fmt: skip
    runner = ModelRunner(config)
    model = runner.model
    if kind is not None:
        requantize_linears(model, kind)
    prompt = list(range(100, 114))
    model(torch.tensor(prompt), runner.kv_caches, _meta(runner, len(prompt), 0))
    head = model.lm_head.quantized
    assert head is not None
    dense = torch.cat([part.dequantize() for part in head.parts])
    for j in range(4):  # each step twice: fused, then plain (the same K/V at the same slot)
        ids, meta = torch.tensor([7 + 31 * j]), _meta(runner, 1, len(prompt) + j)
        normed, token = model.forward_greedy(ids, runner.kv_caches, meta)
        assert token is not None, "the fused head did not run"
        plain = model(ids, runner.kv_caches, meta)
        assert torch.equal(normed, plain)
        logits = model.compute_logits(plain)
        assert model._head is not None and torch.equal(model._head.logits, logits[0])
        assert token.tolist() == cpu_kernels.argmax(logits).tolist()
        reference = F.linear(plain, dense)
        torch.testing.assert_close(logits, reference, atol=2e-3, rtol=1e-3)
        assert token.tolist() == reference.argmax(dim=-1).tolist()


def test_fused_head_takes_the_first_largest_and_the_first_nan(vnni_two_threads: None) -> None:
    """A head of identical rows (every logit equal, in both threads' shares) gives token 0,
    argmax's first; with two rows' scales NaN, the first of them, as argmax counts NaN."""
    rows, width = 203, 64  # not a whole number of four-row tiles
    raw = np.repeat(random_blocks("Q8_0", 1, width, seed=3), rows, axis=0)
    weight = from_gguf(raw, "Q8_0", rows, width)
    head = GreedyHead(QuantizedLinear([weight]), torch.ones(width), 1e-6)
    hidden, residual = torch.randn(1, width), torch.randn(1, width)
    fused = head(hidden, residual.clone())
    assert fused is not None
    logits = head.logits  # the kernel's own (F.linear's blocking need not tie them)
    assert bool((logits == logits[0]).all()) and fused[1].tolist() == [0]
    weight.scales[[170, 30], 0] = float("nan")
    fused = head(hidden, residual.clone())
    assert fused is not None and fused[1].tolist() == [30]
    expected = cpu_kernels.argmax(QuantizedLinear([weight])(fused[0]))
    assert expected.tolist() == [30]


def test_one_stream_greedy_takes_the_fused_head_and_keeps_the_plain_tokens(
    smollm2_gguf: Path, mini_scheduler: Any, vnni_two_threads: None, monkeypatch: Any
) -> None:
    """Through the runner: a greedy stream without logprobs runs the fused head on every
    decode step, and its tokens are the plain path's (fused_decode off: layer by layer)."""
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=16, max_num_seqs=2,
        gguf_activations="int8",
    )  # fmt: skip
    runner = ModelRunner(config)
    kernel = cpu_kernels.greedy_head_kernel()
    calls: list[int] = []

    def counted(*args: Any) -> int:
        calls.append(1)
        return int(kernel(*args))

    monkeypatch.setattr(cpu_kernels, "greedy_head_kernel", lambda: counted)
    outputs = []
    for fused in (False, True):
        runner.model.fused_decode = fused
        sched = mini_scheduler(runner)
        sched.add("r", [1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0.0), max_tokens=16)
        outputs.append(sched.run()["r"])
    assert len(calls) == 15  # every decode step after the prefill's sample
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16
