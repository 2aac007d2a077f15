"""Which model class serves a checkpoint, from ``architectures`` in config.json.

Each entry names our class and the flags that architecture implies beyond what
its config.json spells out (Qwen2 always has a q/k/v bias, Qwen3 normalises q
and k per head). An unsupported architecture is a clear error that lists the
supported ones.

Never imports trio or transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import ModelConfig
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .mixtral import MixtralForCausalLM
from .moe import MoeForCausalLM
from .phi3 import Phi3ForCausalLM


@dataclass(frozen=True)
class ArchSpec:
    """Our model class for one HF architecture, with config overrides."""

    model_class: type[nn.Module]
    overrides: dict[str, Any] = field(default_factory=dict)
    partial_rotary: bool = False  # the class loads checkpoints that rotate part of each head
    activations: tuple[str, ...] = ("silu", "swish")  # the MLP activations it computes


_GELU = ("gelu_pytorch_tanh",)


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(LlamaForCausalLM),
    "MistralForCausalLM": ArchSpec(LlamaForCausalLM),
    "Qwen2ForCausalLM": ArchSpec(LlamaForCausalLM, {"qkv_bias": True, "o_bias": False}),
    "Qwen3ForCausalLM": ArchSpec(LlamaForCausalLM, {"qk_norm": True}),
    "Phi3ForCausalLM": ArchSpec(Phi3ForCausalLM, partial_rotary=True),
    "MixtralForCausalLM": ArchSpec(MixtralForCausalLM, {"norm_topk_prob": True}),
    "Qwen2MoeForCausalLM": ArchSpec(MoeForCausalLM, {"qkv_bias": True, "o_bias": False}),
    "Qwen3MoeForCausalLM": ArchSpec(MoeForCausalLM, {"qk_norm": True}),
    "Gemma2ForCausalLM": ArchSpec(Gemma2ForCausalLM, activations=_GELU),
    "Gemma3ForCausalLM": ArchSpec(Gemma3ForCausalLM, {"qk_norm": True}, activations=_GELU),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve_architecture(cfg: ModelConfig) -> tuple[type[LlamaForCausalLM], ModelConfig]:
    """The model class for ``cfg`` and the config with the architecture's flags applied.

    Raises ``ValueError`` naming the architecture and the supported ones.
    """
    spec = ARCHITECTURES.get(cfg.architecture)
    if spec is None:
        name = cfg.architecture or "(config.json names no architecture)"
        raise ValueError(
            f"unsupported model architecture {name}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    if cfg.hidden_act not in spec.activations:
        raise ValueError(
            f"hidden_act: {cfg.hidden_act!r} is not supported for {cfg.architecture} "
            f"(supported: {', '.join(spec.activations)})"
        )
    if cfg.rope.partial_rotary_factor != 1.0 and not spec.partial_rotary:
        raise ValueError(
            f"partial_rotary_factor: {cfg.rope.partial_rotary_factor} is not supported "
            f"for {cfg.architecture} (only 1.0)"
        )
    model_class = spec.model_class
    assert issubclass(model_class, LlamaForCausalLM)
    return model_class, dataclasses.replace(cfg, **spec.overrides)
