"""Random GGUF blocks of every type legato keeps quantized, and gguf-py's own
dequantization of them: the reference weights that kernel tests and benchmarks
compare against; and a loaded model's quantized matrices re-quantized to another type.

Test and benchmark support only: never imported by the engine.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

__all__ = ["BLOCK_SHAPES", "random_blocks", "reference_weight", "requantize_linears"]

BLOCK_SHAPES: dict[str, tuple[int, int]] = {  # (weights per block, bytes per block)
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
_HALF_FIELDS: dict[str, tuple[int, ...]] = {  # byte offsets of the fp16 scales / mins
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``[rows, bytes]`` GGUF blocks of ``kind``: random codes and sub-scales, fp16
    scales drawn from a sane range (random bytes there would be NaN or huge)."""
    rng = np.random.default_rng(seed)
    per, size = BLOCK_SHAPES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for at in _HALF_FIELDS[kind]:
        half = rng.uniform(-0.05, 0.05, size=(rows, cols // per)).astype(np.float16)
        blocks[..., at : at + 2] = half.view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, -1)


def reference_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    """gguf-py's dequantization of ``raw``: the fp32 weight the blocks stand for."""
    values = dequantize(raw, GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).copy())


def requantize_linears(model: torch.nn.Module, kind: str) -> None:
    """Every kept-quantized matrix of ``model`` re-quantized to ``kind`` (Q8_0, Q4_0, Q4_1,
    Q5_0 or Q5_1) by gguf-py's own quantizer, in place: the same model held in another
    type, where no file of that type is at hand."""
    from gguf.quants import quantize

    from ..models.layers import Linear
    from ..models.quantized import QuantizedLinear, from_gguf

    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            dense = torch.cat([part.dequantize() for part in module.quantized.parts]).numpy()
            raw = quantize(dense, GGMLQuantizationType[kind])
            module.quantized = QuantizedLinear([from_gguf(raw, kind, *dense.shape)])
