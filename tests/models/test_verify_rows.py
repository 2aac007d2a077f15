"""A speculative verification step's rows are computed exactly as plain decode steps compute
them: on the default model's kept-quantized GGUF weights, one forward over each sequence's
last token and drafts (``rows_as_decodes``, the one-call decode stack) gives, row for row,
the bit-identical logits and KV cache that decoding the same tokens one step at a time gives.
That is what keeps greedy outputs token-identical with and without speculation."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from legato.config import EngineConfig
from legato.models import cpu_kernels
from legato.models.runner import ModelRunner
from legato.models.step_metadata import build_metadata
from legato.testing.gguf_blocks import requantize_linears

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 500], [42, 43]]
FOLLOWING = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35], [5, 6, 7, 8, 9]]
BLOCKS_PER_SEQ = 2


def _forward(
    runner: ModelRunner, tokens: list[list[int]], starts: list[int], as_decodes: bool = False
) -> torch.Tensor:
    """One forward over ``tokens[s]`` of each sequence ``s`` from ``starts[s]``: the hidden
    rows (flat, sequence after sequence)."""
    q_lens = np.array([len(t) for t in tokens], dtype=np.int64)
    table = np.arange(len(tokens) * BLOCKS_PER_SEQ, dtype=np.int32).reshape(len(tokens), -1)
    meta, _, _ = build_metadata(
        np.array(starts, dtype=np.int64), q_lens, table, runner.block_size, runner.device
    )
    if as_decodes:
        meta = replace(meta, rows_as_decodes=True)
    ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64)
    hidden: torch.Tensor = runner.model(ids, runner.kv_caches, meta)
    return hidden


@pytest.mark.parametrize(
    ("gguf_activations", "num_seqs", "kind"),
    [
        ("int8", 1, None),
        ("int8", 3, None),
        ("fp32", 1, None),
        ("fp32", 3, None),
        ("int8", 1, "Q5_0"),  # 5-bit codes: the nibbles plus a bit plane
        ("int8", 1, "Q8_0"),  # 8-bit codes: the rows' digits as int16 pairs (vpdpwssd)
    ],
)
def test_verified_rows_equal_plain_decode_bit_for_bit(
    smollm2_gguf: Path,
    decode_stack_calls: Callable[[], AbstractContextManager[list[tuple[int, int]]]],
    gguf_activations: str,
    num_seqs: int,
    kind: str | None,
) -> None:
    """``num_seqs`` sequences with 4 drafts each: the verification step's 5 rows a sequence
    (through the decode stack: its one call sees them all) against 5 plain decode steps of
    ``num_seqs`` rows; logits and KV cache equal bit for bit (int8 activations at one
    sequence, the fp32 tile at three; in fp32 mode one sequence takes the one-row kernel);
    also with the matrices re-quantized to Q5_0 (the 5-bit layout's integer rows) and to Q8_0
    (the 8-bit layout's, whose tile over several rows reads the digits as int16 pairs)."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=16, max_num_seqs=4,
        gguf_activations=gguf_activations,
    )  # fmt: skip
    runner = ModelRunner(config)
    if kind is not None:  # the file's matrices held as another type
        requantize_linears(runner.model, kind)
    prompts, following = PROMPTS[:num_seqs], FOLLOWING[:num_seqs]
    lens = [len(p) for p in prompts]

    def prefill() -> None:
        for key, value in runner.kv_caches:
            key.zero_()
            value.zero_()
        _forward(runner, prompts, [0] * num_seqs)

    prefill()
    plain = []  # [step][seq] logits rows
    for j in range(len(following[0])):
        hidden = _forward(runner, [[f[j]] for f in following], [n + j for n in lens])
        plain.append(runner.model.compute_logits(hidden))
    plain_cache = [tuple(c.clone() for c in pair) for pair in runner.kv_caches]

    prefill()
    with decode_stack_calls() as calls:
        hidden = _forward(runner, following, lens, as_decodes=True)
    assert calls == [(num_seqs * len(following[0]), num_seqs)]
    verified = runner.model.compute_logits(hidden, num_seqs)
    width = len(following[0])
    for s in range(num_seqs):
        for j in range(width):
            assert torch.equal(verified[s * width + j], plain[j][s]), (s, j)
    for (k, v), (pk, pv) in zip(runner.kv_caches, plain_cache, strict=True):
        assert torch.equal(k, pk) and torch.equal(v, pv)
