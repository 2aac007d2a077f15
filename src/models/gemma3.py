"""Gemma 3, text (``Gemma3ForCausalLM``): Gemma 2 with q/k norms and a rotary per layer type.

What differs from :mod:`legato.models.gemma2`:

- per-head RMSNorm of queries and keys before rotary (Gemma's ``1 + w`` norm,
  shifted at load like every other norm);
- the sliding-window layers rotate with their own base frequency
  (``rope_parameters["sliding_attention"]``, older configs ``rope_local_base_freq``,
  default 10 000) and no scaling; the global layers with ``rope_theta`` and the
  config's scaling (linear in the 4B-27B models);
- no soft-capping in the released configs (the Gemma 2 code applies it when set);
- five sliding layers to one global (``sliding_window_pattern`` 6) by default.

The multimodal ``Gemma3ForConditionalGeneration`` checkpoints are not read here.

Never imports trio or transformers.
"""

from __future__ import annotations

import torch

from .attention_backend import AttentionMetadata, Backend, StepContext
from .config import ModelConfig, RopeConfig
from .gemma2 import Gemma2ForCausalLM
from .rotary import RotaryEmbedding

LOCAL_ROPE_THETA = 10_000.0  # transformers' default base of the sliding layers


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text) causal LM; the registry turns on ``qk_norm`` for it."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> None:
        super().__init__(cfg, backend, dtype, device, max_positions)
        local = cfg.local_rope or RopeConfig(theta=LOCAL_ROPE_THETA)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, local, max_positions, device)

    def step_contexts(self, meta: AttentionMetadata) -> tuple[StepContext, StepContext]:
        """``(global, sliding)`` step contexts, each with its own rotary table."""
        full_cache, full_meta = self.rotary.for_step(meta)
        local_cache, local_meta = self.local_rotary.for_step(meta)
        return (
            self.backend.begin_step(full_meta, full_cache, self.dtype),
            self.backend.begin_step(local_meta, local_cache, self.dtype),
        )
