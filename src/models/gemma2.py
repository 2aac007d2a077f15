"""Gemma 2 (``Gemma2ForCausalLM``) on the paged KV cache.

What differs from :mod:`legato.models.llama`:

- sandwich norms: each sublayer's output is normalised before it joins the
  residual (``post_attention_layernorm``, ``post_feedforward_layernorm``) and
  the MLP has its own input norm (``pre_feedforward_layernorm``);
- Gemma's RMSNorm multiplies by ``1 + weight``: the checkpoint's norm weights
  get 1 added at load, so the shared RMSNorm (and its fused kernels) computes it;
- GeGLU (``gelu_pytorch_tanh``) instead of SwiGLU;
- the embedding is scaled by ``sqrt(hidden_size)`` (rounded to the model dtype);
- attention scale ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- logit soft-capping: ``cap * tanh(x / cap)`` on the attention scores
  (``attn_logit_softcapping``) and on the final logits (``final_logit_softcapping``);
- sliding-window layers interleaved with global ones (``layer_types``; older
  configs: every other layer, see :mod:`legato.models.config`).

The attention soft cap goes through every backend: the Triton kernels cap the
scores in their online softmax; the torch backend computes capped layers' scores
whole (SDPA has no cap, and the native CPU decode kernel is bypassed for them).

:class:`Gemma2ForCausalLM` is also the base of Gemma 3 (:mod:`legato.models.gemma3`),
which adds q/k norms and a rotary of its own for the sliding layers
(:meth:`Gemma2ForCausalLM.step_contexts`).

Never imports trio or transformers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch
from torch import nn

from .attention_backend import AttentionMetadata, Backend, StepContext
from .config import ModelConfig
from .layers import MLP, Attention, RMSNorm
from .llama import KVCache, LlamaForCausalLM
from .quantized import QuantizedWeight

_NORM_SUFFIXES = ("norm.weight",)  # every RMSNorm of the checkpoint: (1 + w) at run time


class Gemma2DecoderLayer(nn.Module):
    """Norm, attention, norm; norm, GeGLU MLP, norm. The residual is carried separately."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        layer: int = 0,
    ) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype, device)

        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.input_layernorm = norm()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.rms_norm_eps, backend, dtype, device,
            sliding_window=cfg.window_of(layer),
            scale=scalar**-0.5,
            softcap=cfg.attn_logit_softcapping,
        )  # fmt: skip
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, backend, dtype, device,
            activation=cfg.hidden_act,
        )  # fmt: skip
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        step: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, kv_cache, step))
        hidden, residual = self.pre_feedforward_layernorm.add_forward(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM: the Llama skeleton with Gemma's layers, scaling and soft caps."""

    layer_class = Gemma2DecoderLayer

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> None:
        super().__init__(cfg, backend, dtype, device, max_positions)
        # transformers rounds sqrt(hidden) to the model dtype before it multiplies
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))

    def step_contexts(self, meta: AttentionMetadata) -> tuple[StepContext, StepContext]:
        """``(global, sliding)``: the step context of the full-attention layers and of the
        sliding-window ones. Gemma 2 rotates both alike: one context."""
        cos_sin_cache, meta = self.rotary.for_step(meta)
        step = self.backend.begin_step(meta, cos_sin_cache, self.dtype)
        return step, step

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward`."""
        full_step, sliding_step = self.step_contexts(meta)
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            assert isinstance(layer, Gemma2DecoderLayer)
            step = sliding_step if layer.self_attn.sliding_window is not None else full_step
            hidden, residual = layer(hidden, residual, kv_cache, step)
        assert residual is not None
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, sequences: int | None = None) -> torch.Tensor:
        """``[N, vocab]`` logits, soft-capped when the config says so."""
        logits = super().compute_logits(hidden, sequences)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        filled_elsewhere: Collection[str] = (),
    ) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, with every norm weight ``w`` loaded as
        ``1 + w`` (Gemma's RMSNorm scales by it)."""
        super().load_weights(self._shift_norms(weights), filled_elsewhere)

    @staticmethod
    def _shift_norms(
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        for name, tensor in weights:
            if name.endswith(_NORM_SUFFIXES) and isinstance(tensor, torch.Tensor):
                tensor = tensor.float() + 1.0
            yield name, tensor
