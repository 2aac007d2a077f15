"""Quantized weights (legato.models.quantized): each GGUF type kept quantized gives the
weights ``gguf.quants.dequantize`` gives, and its matmul equals "dequantize, then F.linear",
on random blocks, odd shapes, the native kernel and the plain-torch fallback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from legato import LLM
from legato.models import cpu_kernels
from legato.models.attention_backend import TorchBackend
from legato.models.config import load_model_config
from legato.models.layers import Linear
from legato.models.loader import load_model
from legato.models.quantized import KEPT_TYPES, QuantizedLinear, from_gguf, unpack_codes
from legato.models.registry import resolve_architecture
from legato.protocol.params import SamplingParams
from legato.testing.gguf_blocks import random_blocks, reference_weight, requantize_linears


@pytest.fixture(params=[True, False], ids=["native", "fallback"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    if request.param and not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    if not request.param:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    yield bool(request.param)


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_dequantized_values_are_gguf_values(kind: str) -> None:
    """Repacking loses nothing: the weight the codes stand for is bit-identical to gguf's."""
    raw = random_blocks(kind, 7, 512, seed=1)
    weight = from_gguf(raw, kind, 7, 512)
    assert torch.equal(weight.dequantize(), reference_weight(raw, kind))


@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K"])
def test_codes_unpack_on_the_codes_device(kind: str) -> None:
    """Bit planes are unpacked where the codes are (the GPU benchmark's reference and
    the dense copies of a CUDA model): ``meta`` stands for a device other than the CPU,
    and any tensor left on the CPU would refuse to mix with it."""
    weight = from_gguf(random_blocks(kind, 3, 256, seed=2), kind, 3, 256)
    unpacked = unpack_codes(weight.codes.to("meta"), weight.bits)
    assert unpacked.device.type == "meta" and unpacked.shape == (3, 256)


@pytest.mark.parametrize("kind", KEPT_TYPES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 13, 256), (5, 37, 768), (17, 6, 512), (2, 11, 1280), (7, 9, 2304)],
)
def test_matmul_matches_dequantize_then_linear(
    native: bool, kind: str, rows: int, out_features: int, in_features: int
) -> None:
    """The fp32 kernel (the fidelity path): odd row counts (tails of the one-row kernel's 4
    weight rows, the tile's 4 weight rows and its 4-row input tiles), 1 to 17 input rows,
    rows wider than one 1024-code panel block (1280, 2304)."""
    raw = random_blocks(kind, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x, reference_weight(raw, kind))
    weight = from_gguf(raw, kind, out_features, in_features)
    got = QuantizedLinear([weight], int8_max_rows=0)(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q6_K"])
def test_fp32_tile_rows_do_not_depend_on_the_call(kind: str) -> None:
    """A row's result from the fp32 tile (2 or more rows) is the same bit for bit whatever
    the other rows of the call and the row's place among them (verification rows rely on
    it: tests/models/test_verify_rows.py): each of 11 rows, 1280 wide (two panel blocks),
    against calls of 2..10 rows that hold it at another place and in a tail tile."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    raw = random_blocks(kind, 10, 1280, seed=3)
    weight = from_gguf(raw, kind, 10, 1280)
    layer = QuantizedLinear([weight], int8_max_rows=0)
    x = torch.randn(11, 1280, generator=torch.Generator().manual_seed(4))
    whole = layer(x)
    for start, stop in [(0, 2), (1, 4), (3, 6), (5, 11), (2, 9), (0, 10), (9, 11)]:
        assert torch.equal(layer(x[start:stop].contiguous()), whole[start:stop]), (start, stop)
    torch.testing.assert_close(
        whole, F.linear(x, reference_weight(raw, kind)), atol=1e-4, rtol=1e-4
    )


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the int8-activation kernel sees it: per block of 32, ``y = x * 127 / max|x|``
    as two int8 digits (``q = round(y)``, ``r = round(256 (y - q))``, halves to even), times
    ``d = max|x| / 127 / 256`` again (in fp32)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    y = blocks * inv
    high = torch.round(y)
    low = torch.round((y - high) * 256.0).clamp(-127, 127)
    return ((256.0 * high + low) * (amax / 127.0 / 256.0)).reshape(x.shape)


@pytest.fixture(params=cpu_kernels.QUANTIZED_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path of the int8-activation kernel this CPU runs, pinned for the test."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    best = cpu_kernels.quantized_isa()
    if cpu_kernels.QUANTIZED_ISAS.index(request.param) > cpu_kernels.QUANTIZED_ISAS.index(best):
        pytest.skip(f"this CPU does not run {request.param}")
    assert cpu_kernels.quantized_isa(request.param) == request.param
    yield str(request.param)
    cpu_kernels.quantized_isa("avx512_vnni")  # back to the best this CPU runs


@pytest.mark.parametrize("kind", KEPT_TYPES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 13, 256), (5, 37, 768), (17, 6, 512)]
)
def test_int8_activation_matmul_matches_dequantize_then_linear(
    isa: str, kind: str, rows: int, out_features: int, in_features: int
) -> None:
    """The int8-activation kernel, on every path, equals "dequantize, then F.linear" on the
    int8-rounded input (the offset term uses the exact input, as the kernel does) to fp32
    rounding; and the exact input's product within the activation rounding (2e-4 of the
    largest output: two int8 digits hold about 16 bits)."""
    raw = random_blocks(kind, out_features, in_features, seed=rows)
    weight = from_gguf(raw, kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = torch.empty(rows, out_features)
    codes, scales, offsets = weight.codes, weight.scales, weight.offsets
    cpu_kernels.quantized_matmul(
        x, codes, scales, offsets, weight.bits, weight.group, out, int8_activations=True
    )
    rounded = int8_rounded(x)
    expected = F.linear(rounded, reference_weight(raw, kind))
    if offsets is not None:  # the kernel's offset term sums the exact input
        group_sum = (x - rounded).view(rows, -1, weight.group).sum(-1)
        expected += F.linear(group_sum, offsets)
    # the offset term is summed apart from the codes' term: fp32 cancellation between the two
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(out, expected, atol=2e-4 * scale, rtol=1e-4)
    exact = F.linear(x, reference_weight(raw, kind))
    assert (out - exact).abs().max() <= 5e-4 * scale


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_activation_digits_on_avx512_are_the_scalar_digits(kind: str, rows: int) -> None:
    """The int8-activation kernel's outputs, bit for bit, whether its activations' digits
    are computed on AVX-512 or one value at a time (same tiles: only the digits differ).
    Inputs that reach the rounding's edges: values exactly halfway between two codes of a
    block, a zero block, one huge and one tiny value, and random rows; 8-bit codes read the
    plain order (and int16 pairs beyond one row), the rest the nibble order."""
    if not cpu_kernels.available() or not cpu_kernels.activation_digits_avx512():
        pytest.skip("this CPU has no AVX-512 digits path")
    in_features = 768 if kind.endswith("_K") else 608  # 608: a partial 128-code step
    raw = random_blocks(kind, 11, in_features, seed=rows)
    weight = from_gguf(raw, kind, 11, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = torch.arange(32) - 15.5  # max 16.5: y = v * 127 / 16.5 lands on halves
    x[0, 32:64] = torch.linspace(-127, 127, 32) / 254  # ties of the low digit
    x[rows - 1, 64:96] = 0.0
    x[rows - 1, 96] = 3e4
    x[rows - 1, 97] = 1e-30
    outs = []
    for avx512 in (True, False):
        assert cpu_kernels.activation_digits_avx512(avx512) == avx512
        out = torch.empty(rows, 11)
        cpu_kernels.quantized_matmul(
            x, weight.codes, weight.scales, weight.offsets, weight.bits, weight.group, out,
            int8_activations=True,
        )  # fmt: skip
        outs.append(out)
    cpu_kernels.activation_digits_avx512(True)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_int8_activation_odd_widths(isa: str, kind: str) -> None:
    """Widths that end the VNNI loops with a partial step: 32 * odd for the 64-code step of
    8-bit codes; 32, 64 and 96 codes past a multiple of 128 for the 128-code step of 4/5/6-bit
    codes (a 5-bit plane then holds 4, 8 or 12 of its 16 bytes), one row and several; one row
    over 45 outputs reaches the tiles that prefetch the rows 16 ahead (and their bit planes).
    K-quants: widths of 256 * odd."""
    shapes = [(1, 5, 32), (3, 11, 96), (2, 7, 608), (1, 45, 608), (1, 9, 576), (3, 13, 320)]
    if kind.endswith("_K"):
        shapes = [(1, 5, 256), (3, 11, 768), (16, 7, 1280), (1, 45, 768)]
    for rows, out_features, in_features in shapes:
        raw = random_blocks(kind, out_features, in_features, seed=in_features)
        weight = from_gguf(raw, kind, out_features, in_features)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        out = torch.empty(rows, out_features)
        cpu_kernels.quantized_matmul(
            x, weight.codes, weight.scales, weight.offsets, weight.bits, weight.group, out,
            int8_activations=True,
        )  # fmt: skip
        rounded = int8_rounded(x)
        expected = F.linear(rounded, reference_weight(raw, kind))
        if weight.offsets is not None:
            group_sum = (x - rounded).view(rows, -1, weight.group).sum(-1)
            expected += F.linear(group_sum, weight.offsets)
        scale = max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(out, expected, atol=2e-4 * scale, rtol=1e-4)


# bytes held per byte of the file's blocks, at most (the module docstring's table)
_HELD_PER_FILE_BYTE = {"Q8_0": 1.06, "Q4_0": 1.34, "Q4_1": 1.2, "Q5_0": 1.1}
_HELD_PER_FILE_BYTE |= {"Q5_1": 1.17, "Q4_K": 1.34, "Q5_K": 1.28, "Q6_K": 1.22}


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_held_bytes_stay_near_the_file(kind: str) -> None:
    """Memory stays near the file: the 5- and 6-bit codes are a nibble plus bit planes (5 or
    6 bits a code), not a byte each (which held Q5_0 at 1.64x and Q6_K at 1.83x the file)."""
    raw = random_blocks(kind, 3, 512, seed=2)
    weight = from_gguf(raw, kind, 3, 512)
    assert weight.codes.shape == (3, 512 * weight.bits // 8)
    assert weight.nbytes <= _HELD_PER_FILE_BYTE[kind] * raw.nbytes


def test_mixed_layouts_fill_their_own_columns(native: bool) -> None:
    """A fused projection of Q4_K, Q4_K and Q6_K blocks (as a Q4_K_M file stores q, k, v):
    the two Q4_K blocks are stacked into one, the Q6_K block writes the last columns; a
    strided and a bf16 input give the same."""
    parts = [("Q4_K", 10), ("Q4_K", 6), ("Q6_K", 9)]
    raws = [random_blocks(kind, n, 256, seed=i) for i, (kind, n) in enumerate(parts)]
    layer = QuantizedLinear([from_gguf(r, k, n, 256) for r, (k, n) in zip(raws, parts)])
    assert len(layer.parts) == 2
    weight = torch.cat([reference_weight(r, k) for r, (k, _) in zip(raws, parts)])
    wide = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    x = wide[:, ::2]  # a strided input
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-4, rtol=1e-4)
    dense = x.contiguous()  # the direct path: one kernel call per part into its columns
    torch.testing.assert_close(layer(dense), F.linear(dense, weight), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        layer(x.bfloat16()).float(), F.linear(x.bfloat16().float(), weight), atol=2e-2, rtol=2e-2
    )


def test_kernel_refuses_what_it_cannot_take() -> None:
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels did not build here")
    weight = from_gguf(random_blocks("Q8_0", 4, 64), "Q8_0", 4, 64)
    out = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="quantized_matmul"):  # width not the weight's
        cpu_kernels.quantized_matmul(
            torch.randn(2, 32), weight.codes, weight.scales, None, 8, 32, out
        )
    assert not out.any()


def test_unsupported_type_is_refused() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        from_gguf(np.zeros((1, 84), np.uint8), "Q2_K", 1, 256)


# -- the default model, end to end ----------------------------------------------------


_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
]


@pytest.mark.parametrize("device", _DEVICES)
def test_default_model_loads_quantized(smollm2_gguf: Path, device: str) -> None:
    """Every matrix of the Q4_1 file (the Q8_0 embedding, tied LM head, included) is held
    quantized on the model's device, no parameter keeps an fp32 copy of it, and the model's
    quantized bytes stay within 1.3x of the file."""
    cfg = resolve_architecture(load_model_config(smollm2_gguf))[1]
    model = load_model(
        smollm2_gguf, cfg, TorchBackend(), torch.float32, torch.device(device), 64,
        keep_quantized=True,
    )  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    assert all(p.codes.device.type == device for m in linears for p in m.quantized.parts)  # type: ignore[union-attr]
    assert model.model.embed_tokens.quantized is not None
    dense = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert dense == 0
    assert model.quantized_bytes() <= 1.3 * smollm2_gguf.stat().st_size


@pytest.mark.parametrize("device", _DEVICES)
def test_greedy_tokens_equal_the_dequantized_fp32_path(smollm2_gguf: Path, device: str) -> None:
    """The kernels (native on CPU, Triton on CUDA, decode CUDA graphs included) compute in
    fp32 from bit-identical weights: greedy decoding of the default model gives the tokens
    the dequantized fp32 path gives (``gguf_dequantize=True``)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for widened in (False, True):
        with LLM(
            str(smollm2_gguf), executor="inproc", gguf_dequantize=widened, max_num_seqs=4,
            gguf_activations="fp32", dtype="float32", device=device,
        ) as llm:  # fmt: skip
            tokens[widened] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert tokens[False] == tokens[True]


_REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which plants",
    "The three laws of motion are",
    "To make a cup of tea, first",
]


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_int8_activations_teacher_forced_agreement(
    smollm2_gguf: Path, mini_scheduler: Any, kind: str
) -> None:
    """The default model (its Q4_1 file, and the same re-quantized to Q8_0) on real prompts:
    greedy continuations from the fp32-activation path, then the int8-activation path fed
    prompt + continuation; its argmax equals the continuation's token at >= 97% (Q4_1) /
    99% (Q8_0) of the positions (ranks from prompt logprobs)."""
    from legato.config import EngineConfig
    from legato.models.runner import ModelRunner
    from legato.tokenizer_loading import load_gguf_tokenizer

    n = 32
    tokenizer = load_gguf_tokenizer(smollm2_gguf)
    prompts = [tokenizer.encode(text) for text in _REAL_PROMPTS]
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", num_kv_blocks=64, max_num_seqs=8,
        gguf_activations="fp32",
    )  # fmt: skip
    runner = ModelRunner(config)
    if kind == "Q8_0":
        requantize_linears(runner.model, "Q8_0")
    runner.model.set_int8_max_rows(0)
    sched = mini_scheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=n)
    continuations = sched.run()
    runner.model.set_int8_max_rows(1 << 20)  # the teacher-forced prefill too
    sched = mini_scheduler(runner)
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt + continuations[f"r{i}"], params, max_tokens=1)
    sched.run()
    ranks = []
    for i, prompt in enumerate(prompts):
        entries = sched.done[f"r{i}"].prompt_logprobs
        ranks += [entry.ranks[0] for entry in entries[len(prompt) :]]
    assert len(ranks) == n * len(prompts)
    rate = sum(r == 1 for r in ranks) / len(ranks)
    print(f"{kind} int8 activations: teacher-forced top-1 agreement with fp32 {rate:.1%}")
    assert rate >= (0.99 if kind == "Q8_0" else 0.97)
