"""Read a PEFT LoRA adapter directory and check it against the base model.

An adapter is a directory with ``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft``'s ``save_pretrained`` writes it. It
may target any of the decoder's seven projections (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) in any
subset of layers. :func:`load_peft_adapter` returns a :class:`LoRAAdapter`
whose ``B`` matrices already carry the adapter's scaling (``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with rsLoRA), so applying it is two matmuls.

Anything that cannot be served exactly is refused with a :class:`LoRAError`
naming the field or tensor: a rank above ``max_lora_rank``, a tensor whose
shape does not fit the base model, a module outside the seven, DoRA, trained
biases, ``modules_to_save``, a pickled ``adapter_model.bin`` (never unpickled).

Never imports trio.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..protocol.errors import ValidationError
from .config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# projection name -> its sub-module in a decoder layer
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)"
    r"(?:\.[^.]+)?\.weight$"
)


class LoRAError(ValidationError):
    """An adapter that cannot be loaded or served; ``field`` names what is wrong."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each target projection of ``cfg``."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.q_size),
        "k_proj": (h, cfg.kv_size),
        "v_proj": (h, cfg.kv_size),
        "o_proj": (cfg.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's low-rank update: ``delta(x) = (x @ a.T) @ b.T``.

    ``a`` is ``[rank, in_features]``; ``b`` is ``[out_features, rank]`` with the
    adapter's scaling folded in.
    """

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded adapter: ``weights[(layer, projection)]`` for every module it targets."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank of any of its modules
    weights: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def _read_config(root: Path) -> dict[str, Any]:
    path = root / CONFIG_FILE
    if not path.is_file():
        raise LoRAError("lora_path", f"{root} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError("lora_path", f"{path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError("lora_path", f"{path} must hold a JSON object")
    return config


def _check_config(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError("peft_type", f"only LORA adapters are supported, got {peft_type!r}")
    if config.get("use_dora"):
        raise LoRAError("use_dora", "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(
            "bias", f"adapters that train biases are not supported ({config['bias']!r})"
        )
    if config.get("modules_to_save"):
        raise LoRAError(
            "modules_to_save",
            f"adapters with fully trained modules are not supported ({config['modules_to_save']})",
        )
    if config.get("fan_in_fan_out"):
        raise LoRAError("fan_in_fan_out", "fan_in_fan_out adapters are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise LoRAError(key, f"must be a positive number, got {value!r}")


def _pattern_value(patterns: Any, module: str, default: float) -> float:
    """peft's rank/alpha pattern lookup: a key matches a module name ending in it."""
    if not isinstance(patterns, dict):
        return default
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return default


def load_peft_adapter(
    path: str | Path,
    cfg: ModelConfig,
    *,
    name: str,
    int_id: int,
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Load the PEFT adapter at ``path`` for a base model shaped like ``cfg``.

    Tensors are cast to ``dtype`` and stay on the CPU. Raises :class:`LoRAError`
    (a ValueError) for anything the engine cannot serve; blocks while reading.
    """
    root = Path(path)
    if not root.is_dir():
        raise LoRAError("lora_path", f"{root} is not a directory")
    config = _read_config(root)
    _check_config(config)
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        extra = (
            " (adapter_model.bin is never unpickled)"
            if (root / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAError("lora_path", f"{root} has no {WEIGHTS_FILE}{extra}")

    shapes = projection_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                match = _TENSOR_RE.match(key)
                if match is None:
                    raise LoRAError(
                        "target_modules",
                        f"tensor {key!r} is not a LoRA weight of a supported module "
                        f"(supported: {', '.join(TARGET_MODULES)})",
                    )
                layer_s, parent, module, which = match.groups()
                if TARGET_MODULES.get(module) != parent:
                    raise LoRAError(
                        "target_modules",
                        f"tensor {key!r} targets {parent}.{module}, which is not supported "
                        f"(supported: {', '.join(TARGET_MODULES)})",
                    )
                layer = int(layer_s)
                if layer >= cfg.num_layers:
                    raise LoRAError(
                        "target_modules",
                        f"tensor {key!r} targets layer {layer}; the model has {cfg.num_layers}",
                    )
                pairs.setdefault((layer, module), {})[which] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad files
        raise LoRAError(
            "lora_path", f"{weights_path} is not a readable safetensors file: {exc}"
        ) from None
    if not pairs:
        raise LoRAError("target_modules", f"{weights_path} holds no LoRA weights")

    default_r = float(config["r"])
    default_alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    adapter = LoRAAdapter(name=name, int_id=int_id, path=str(root), rank=0)
    for (layer, module), pair in sorted(pairs.items()):
        full = f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise LoRAError("target_modules", f"{full} has no lora_{missing} weight")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        rank = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or tuple(a.shape) != (rank, in_features):
            raise LoRAError(
                "lora_A",
                f"{full}.lora_A has shape {tuple(a.shape)}, expected (rank, {in_features})",
            )
        if tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                "lora_B",
                f"{full}.lora_B has shape {tuple(b.shape)}, expected ({out_features}, {rank})",
            )
        if rank > max_lora_rank:
            raise LoRAError(
                "max_lora_rank",
                f"adapter {name!r} has rank {rank} at {full}, above max_lora_rank={max_lora_rank}",
            )
        r = _pattern_value(config.get("rank_pattern"), full, default_r)
        alpha = _pattern_value(config.get("alpha_pattern"), full, default_alpha)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.weights[(layer, module)] = LoRAWeights(
            a=a.to(dtype).contiguous(), b=(b.to(torch.float32) * scaling).to(dtype).contiguous()
        )
        adapter.rank = max(adapter.rank, rank)
    return adapter
