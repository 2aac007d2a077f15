"""The one-call decoder stack (legato.models.decode_stack) against the layer-by-layer forward
it replaces, on the default model's kept-quantized GGUF weights and on an fp32 checkpoint's
dense weights in column panels: decode steps of 1 and of 3 sequences give the same logits,
greedy tokens and KV cache; one sequence's steps (one row, or a verification step's several)
run in one parallel region bit for bit as op by op."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from legato.config import EngineConfig
from legato.models import cpu_kernels, cpu_linear
from legato.models.lora_layers import LoRALayers
from legato.models.quantized import QuantizedLinear, from_gguf
from legato.models.runner import ModelRunner
from legato.models.step_metadata import build_metadata
from legato.protocol.params import SamplingParams
from legato.testing.gguf_blocks import requantize_linears


def _run(runner: ModelRunner, mini_scheduler: Any, fused: bool, prompts: list[list[int]]) -> Any:
    runner.model.fused_decode = fused
    for key, value in runner.kv_caches:
        key.zero_()
        value.zero_()
    sched = mini_scheduler(runner)
    params = SamplingParams(temperature=0.0, logprobs=5)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=12)
    sched.run()
    return sched


def _assert_stack_equals_layer_path(
    runner: ModelRunner,
    mini_scheduler: Any,
    decode_stack_calls: Callable[[], AbstractContextManager[list[tuple[int, int]]]],
    middle: list[int],
    exact: bool,
) -> None:
    """Decode steps of one sequence, then of three (``middle`` the second's prompt): the stack
    runs (its one call is seen, a row a sequence), and tokens, logprobs and the KV cache equal
    the per-layer path's, bit for bit if ``exact``, else to fp32 rounding."""
    for prompts in ([[1, 2, 3, 4, 5, 6, 7]], [[9, 8, 7], middle, [42]]):
        plain = _run(runner, mini_scheduler, False, prompts)
        plain_cache = [tuple(c.clone() for c in pair) for pair in runner.kv_caches]
        with decode_stack_calls() as calls:
            fused = _run(runner, mini_scheduler, True, prompts)
        assert calls and {rows for rows, _ in calls} == {len(prompts)}
        for rid, req in plain.done.items():
            assert fused.done[rid].outputs == req.outputs
            for a, b in zip(fused.done[rid].logprobs, req.logprobs, strict=True):
                assert a.token_ids == b.token_ids
                if exact:
                    assert a.logprobs == b.logprobs
                else:
                    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        for (k, v), (pk, pv) in zip(runner.kv_caches, plain_cache, strict=True):
            if exact:
                assert torch.equal(k, pk) and torch.equal(v, pv)
            else:
                torch.testing.assert_close(k, pk, atol=1e-5, rtol=0)
                torch.testing.assert_close(v, pv, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gguf_activations", ["int8", "fp32"])
def test_fused_decode_equals_the_layer_by_layer_path(
    smollm2_gguf: Path,
    mini_scheduler: Any,
    decode_stack_calls: Callable[[], AbstractContextManager[list[tuple[int, int]]]],
    gguf_activations: str,
) -> None:
    """One stream (the integer kernel with "int8") and three at once (the fp32 tile): the
    stack runs (its one call is seen), and tokens, logprobs and the KV cache equal the
    per-layer path's (the same kernels in the same order: to fp32 rounding)."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=32, max_num_seqs=4,
        gguf_activations=gguf_activations,
    )  # fmt: skip
    runner = ModelRunner(config)
    _assert_stack_equals_layer_path(
        runner, mini_scheduler, decode_stack_calls, [100, 200, 300, 400, 500], exact=False
    )


def test_dense_panels_run_in_the_stack_bit_for_bit(
    llama: Any,
    make_runner: Callable[..., ModelRunner],
    mini_scheduler: Any,
    decode_stack_calls: Callable[[], AbstractContextManager[list[tuple[int, int]]]],
) -> None:
    """An fp32 checkpoint on an AVX-512 CPU holds its linears in column panels; its decode
    steps (1 and 3 sequences, two threads) run the native stack, whose dense projections call
    the same kernel with the same rows: tokens, logprobs and the KV cache equal the
    layer-by-layer path's bit for bit. A LoRA layer's hooks keep the model off the stack, and
    so does one projection quantized among the panels."""
    if not (cpu_kernels.available() and cpu_linear.panels_preferred()):
        pytest.skip("dense panels are for AVX-512 CPUs")
    runner = make_runner(llama)
    torch.set_num_threads(2)  # the dense kernel splits its panels between threads
    _assert_stack_equals_layer_path(
        runner, mini_scheduler, decode_stack_calls, [100, 200, 300, 301, 5], exact=True
    )
    lora = LoRALayers(
        runner.model, runner.model.config, max_loras=1, max_lora_rank=8, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    try:
        with decode_stack_calls() as calls:
            _run(runner, mini_scheduler, True, [[1, 2, 3]])
        assert not calls
    finally:
        lora.detach()
    # One projection quantized among panels: a model of both kinds keeps the layer path.
    o_proj = runner.model.model.layers[0].self_attn.o_proj
    panels = o_proj.packed.panels
    dense = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[: o_proj.packed.out_features]
    raw = quantize(dense.numpy(), GGMLQuantizationType.Q8_0)
    o_proj.quantized = QuantizedLinear([from_gguf(raw, "Q8_0", *dense.shape)])
    try:
        with decode_stack_calls() as calls:
            _run(runner, mini_scheduler, True, [[1, 2, 3]])
        assert not calls
    finally:
        o_proj.quantized = None
    with decode_stack_calls() as calls:
        _run(runner, mini_scheduler, True, [[1, 2, 3]])
    assert calls


@pytest.mark.parametrize("kind", [None, "Q8_0", "Q5_0"])
def test_one_sequence_region_equals_the_op_by_op_stack_bit_for_bit(
    smollm2_gguf: Path, kind: str | None
) -> None:
    """A step of one sequence on the integer path runs its stack in one parallel region (each
    of two threads a share of every matrix, attention shared by heads); pinned off, the same
    stack runs op by op. Seven one-row steps past a block boundary, and a verification step
    over the same seven tokens at once (each row attends to the rows before it), give
    bit-identical hidden rows and KV cache either way, and each verified row is its one-row
    step's, whether the threads share the verified rows' norms and activation codes (each
    thread its rows: 3 and 4) or each does every row: the file's Q4_1, and re-quantized to Q8_0 (the 8-bit tile) and Q5_0 (nibbles
    plus a bit plane)."""
    if not cpu_kernels.available() or cpu_kernels.quantized_isa() != "avx512_vnni":
        pytest.skip("the one-region stack runs on the AVX-512 VNNI path only")
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=8, max_num_seqs=2,
        gguf_activations="int8",
    )  # fmt: skip
    runner = ModelRunner(config)
    if kind is not None:
        requantize_linears(runner.model, kind)
    prompt = list(range(100, 114))  # 14 tokens: the steps cross into the second block
    following = [7 + 31 * j for j in range(7)]  # verified as tiles of 5 and 2 rows
    torch.set_num_threads(2)  # two shares of every matrix and of the heads (restored after)

    def cache() -> list[torch.Tensor]:
        return [c.clone() for pair in runner.kv_caches for c in pair]

    def decode(
        one_region: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        cpu_kernels.decode_one_region(one_region)
        for key, value in runner.kv_caches:
            key.zero_()
            value.zero_()
        _forward(runner, prompt, 0)
        rows = torch.cat([_forward(runner, [t], len(prompt) + j) for j, t in enumerate(following)])
        step_cache = cache()
        for key, value in runner.kv_caches:
            key.zero_()
            value.zero_()
        _forward(runner, prompt, 0)
        verified = _forward(runner, following, len(prompt), as_decodes=True)
        return rows, step_cache, verified, cache()

    try:
        op_rows, op_cache, op_verified, op_verified_cache = decode(False)
        rows, step_cache, verified, verified_cache = decode(True)
        cpu_kernels.decode_verify_rows(False)  # every thread norms and quantizes every row
        _, _, each_verified, each_cache = decode(True)
    finally:
        cpu_kernels.decode_one_region(True)
        cpu_kernels.decode_verify_rows(True)
    for j in range(len(following)):
        assert torch.equal(rows[j], op_rows[j]), j
        assert torch.equal(verified[j], op_verified[j]), j
        assert torch.equal(verified[j], rows[j]), j
        assert torch.equal(each_verified[j], rows[j]), j
    for a, b, c, d, e in zip(
        step_cache, op_cache, verified_cache, op_verified_cache, each_cache, strict=True
    ):
        assert torch.equal(a, b)
        assert torch.equal(c, d)
        assert torch.equal(c, a)
        assert torch.equal(e, a)


def _forward(
    runner: ModelRunner, tokens: list[int], start: int, as_decodes: bool = False
) -> torch.Tensor:
    """One forward of one sequence's ``tokens`` from position ``start`` (blocks 0, 1, ...);
    with ``as_decodes`` its rows as a verification step's (each a decode row)."""
    table = np.arange(4, dtype=np.int32).reshape(1, -1)
    meta, _, _ = build_metadata(
        np.array([start], dtype=np.int64), np.array([len(tokens)], dtype=np.int64), table,
        runner.block_size, runner.device,
    )  # fmt: skip
    if as_decodes:
        meta = replace(meta, rows_as_decodes=True)
    hidden: torch.Tensor = runner.model(
        torch.tensor(tokens, dtype=torch.int64), runner.kv_caches, meta
    )
    return hidden
