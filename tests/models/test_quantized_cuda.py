"""GGUF matrices kept quantized on CUDA: the Triton weight-only matmul in the model.

Runs only where CUDA is present (the GPU machine: benchmarks/gpu/on_device.sh); the
kernel itself is checked against "dequantize, then F.linear" under the interpreter in
tests/kernels/test_quantized_matmul.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from legato import LLM
from legato.models.attention_backend import TorchBackend
from legato.models.config import load_model_config
from legato.models.layers import Linear
from legato.models.loader import load_model
from legato.models.registry import resolve_architecture
from legato.protocol.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_default_model_is_held_quantized_on_the_gpu(smollm2_gguf: Path) -> None:
    """Every matrix of the Q4_1 file sits on the GPU as codes and scales, none as a dense
    copy, within 1.3x of the file's bytes."""
    cfg = resolve_architecture(load_model_config(smollm2_gguf))[1]
    model = load_model(
        smollm2_gguf, cfg, TorchBackend(), torch.float32, torch.device("cuda"), 64,
        keep_quantized=True,
    )  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    assert all(p.codes.is_cuda for m in linears for p in m.quantized.parts)  # type: ignore[union-attr]
    assert sum(p.numel() for p in model.parameters() if p.dim() == 2) == 0
    assert model.quantized_bytes() <= 1.3 * smollm2_gguf.stat().st_size


def test_greedy_tokens_equal_the_dequantized_path_on_the_gpu(smollm2_gguf: Path) -> None:
    """fp32 on CUDA: the kernel forms the weights the dequantized path holds and multiplies in
    IEEE fp32, so greedy decoding (decode CUDA graphs included) gives the same tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    tokens = {}
    for widened in (False, True):
        with LLM(
            str(smollm2_gguf), executor="inproc", gguf_dequantize=widened, max_num_seqs=4,
            dtype="float32", device="cuda",
        ) as llm:  # fmt: skip
            tokens[widened] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert tokens[False] == tokens[True]
