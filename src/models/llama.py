"""The Llama-family decoder on the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3.

One class covers them all; the differences are flags in :class:`ModelConfig`
(qkv bias for Qwen2, per-head q/k RMSNorm for Qwen3, rope scaling for Llama 3,
the sliding window of Mistral's and Qwen2's windowed layers).
Weight names follow the Hugging Face checkpoints; ``q/k/v_proj`` and
``gate/up_proj`` load into fused ``qkv_proj`` and ``gate_up_proj``.

Never imports trio or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

import torch
from torch import nn

from .attention_backend import AttentionMetadata, Backend, StepContext
from .config import ModelConfig
from .decode_stack import DecodeStack
from .greedy_head import GreedyHead
from .layers import MLP, Attention, Embedding, Linear, RMSNorm
from .quantized import QuantizedLinear, QuantizedWeight
from .rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint suffix -> (our parameter suffix, shard index) for the fused projections
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_RE = re.compile(
    r"^(model\.layers\.\d+\.)(" + "|".join(map(re.escape, _FUSED)) + r")\.(weight|bias)$"
)
_IGNORED_RE = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, residual carried separately."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        layer: int = 0,
    ) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, backend, dtype, device)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.qkv_bias,
            cfg.o_bias,
            cfg.qk_norm,
            eps,
            backend,
            dtype,
            device,
            sliding_window=cfg.window_of(layer),
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, backend, dtype, device)
        self.mlp = self.build_mlp(cfg, backend, dtype, device, layer)

    def build_mlp(
        self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype, device: torch.device,
        layer: int,
    ) -> nn.Module:  # fmt: skip
        """Layer ``layer``'s feed-forward block (a mixture of experts overrides this)."""
        del layer
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, backend, dtype, device)

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
        hidden = self.self_attn(hidden, kv_cache, step)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers (``layer_class``, built with the layer index) and the
    final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        layer_class: type[nn.Module] = DecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            layer_class(cfg, backend, dtype, device, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype, device)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a paged KV cache.

    ``forward`` returns the final hidden states ``[T, hidden]`` of a flat batch;
    ``compute_logits`` applies the LM head to the rows that need logits.
    A family whose layers differ sets ``layer_class`` (the layer must keep
    ``self_attn.o_proj`` and ``mlp.down_proj``, which tensor parallelism swaps).
    """

    layer_class: type[nn.Module] = DecoderLayer
    graph_capturable = True  # its forward may be captured in a CUDA graph
    # Its decode steps may run as one native call (decode_stack). Read from this class's
    # own namespace, never inherited: a family whose layers differ does not opt in.
    native_decode_stack = True

    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.dtype = dtype
        self.model = LlamaModel(cfg, backend, dtype, device, self.layer_class)
        if cfg.tie_word_embeddings:  # the head shares the embedding table
            self.lm_head = Linear(0, 0, False, dtype, device)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, device)
        self._full_shapes = {
            name: tuple(p.shape) for name, p in self.named_parameters(remove_duplicate=False)
        }  # each parameter's shape at build, for when its storage is released
        # decode-only steps run the decoder stack in one native call where it qualifies
        # (.decode_stack); False keeps the layer-by-layer path (the fidelity reference)
        self.fused_decode = True
        self._stack: DecodeStack | None = None
        self._head: GreedyHead | None = None  # the fused greedy head (.greedy_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for ``input_ids`` ``[T]`` at ``meta.positions``.

        Writes each layer's new K/V into ``kv_caches`` at ``meta.slot_mapping``.
        """
        stacked = self._through_stack(input_ids, kv_caches, meta)
        if stacked is not None:
            hidden, _ = self.model.norm.add_forward(*stacked)
            return hidden
        cos_sin_cache, meta = self.rotary.for_step(meta)
        step = self.backend.begin_step(meta, cos_sin_cache, self.dtype)
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, kv_cache, step)
        assert residual is not None
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def forward_greedy(
        self, input_ids: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(forward(...), tokens)`` for a step whose every row samples as the bare argmax
        of its logits: ``tokens`` int64 ``[T]`` where one native call gave them (a one-row
        decode step through the fused stack and :mod:`.greedy_head`: the same hidden row and
        the argmax of the same logits as ``compute_logits`` then ``sampler.greedy``), else
        None (the caller computes the logits)."""
        if input_ids.shape[0] == 1 and meta.num_decodes == 1 and not meta.rows_as_decodes:
            head = self._greedy_head()
            stacked = None if head is None else self._through_stack(input_ids, kv_caches, meta)
            if head is not None and stacked is not None:
                fused = head(*stacked)
                if fused is not None:
                    return fused
                hidden, _ = self.model.norm.add_forward(*stacked)
                return hidden, None
        return self(input_ids, kv_caches, meta), None

    def _through_stack(
        self, input_ids: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decode rows only, the decoder stack in one native call: the last
        layer's ``(hidden, residual)``, before the final norm; None where the step or the
        model does not take it (:meth:`_decode_stack`)."""
        decodes = meta.num_decodes == input_ids.shape[0] or meta.rows_as_decodes
        stack = self._decode_stack(kv_caches) if decodes else None
        if stack is None:
            return None
        cos_sin_cache, meta = self.rotary.for_step(meta)
        return stack.run(self.model.embed_tokens(input_ids), meta, cos_sin_cache)

    def _greedy_head(self) -> GreedyHead | None:
        """The fused norm + LM head + argmax when this model qualifies (its own
        ``compute_logits``: a subclass's soft-capping or scaling is not in the kernel)."""
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits:
            return None
        quantized, norm = self.lm_head.quantized, self.model.norm.weight
        head = self._head
        if head is None or not head.matches(quantized, norm):
            head = None
            if quantized is not None and GreedyHead.eligible(quantized, norm, self.lm_head.bias):
                head = GreedyHead(quantized, norm, self.model.norm.eps)
            self._head = head
        return head

    def release_decode_stack(self) -> None:
        """Forget the fused decode stack: it holds the KV cache (and the weights' addresses),
        which a runner going to sleep frees. Built again by the next decode step."""
        self._stack = None
        self._head = None

    def _decode_stack(self, kv_caches: list[KVCache]) -> DecodeStack | None:
        """The one-call decoder stack for a decode-only step, when this model and these
        caches qualify and ``fused_decode`` is on (:mod:`.decode_stack`); else None."""
        if not self.fused_decode or not kv_caches:
            return None
        stack = self._stack
        if stack is None or not stack.matches(kv_caches):
            stack = DecodeStack(self, kv_caches) if DecodeStack.eligible(self, kv_caches) else None
            self._stack = stack
        return stack

    def compute_logits(self, hidden: torch.Tensor, sequences: int | None = None) -> torch.Tensor:
        """``[N, vocab]`` logits in the model dtype. ``sequences``: the rows are those of a
        step of that many sequences (a verification step has several rows a sequence); a
        quantized LM head then computes each row as a plain step of ``sequences`` rows does
        (:meth:`.QuantizedLinear.__call__`), so verified rows match plain decoding."""
        quantized = self.lm_head.quantized
        if sequences is not None and quantized is not None and self.lm_head.bias is None:
            return quantized(hidden, sequences)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    # ------------------------------------------------------------ weights

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        filled_elsewhere: Collection[str] = (),
    ) -> None:
        """Copy checkpoint tensors (HF names) into the parameters.

        ``filled_elsewhere`` names parameters a subclass fills itself (left out of
        the check for missing weights).

        A :class:`~.quantized.QuantizedWeight` is kept as it is: its linear layer
        (or the embedding, and a tied LM head with it) computes from it and the
        parameter's storage is released; a fused layer whose parts are not all
        quantized gets the quantized parts dequantized into its parameter instead.
        Raises ``ValueError`` on an unknown name, a shape mismatch, or a
        parameter no tensor filled (a tied LM head needs none).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}
        dense: set[str] = set()
        shards = {
            "self_attn.qkv_proj": [self.config.q_size, self.config.kv_size, self.config.kv_size],
            "mlp.gate_up_proj": [self.config.intermediate_size] * 2,
        }
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if _IGNORED_RE.search(name):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = name
            offset = 0
            match = _FUSED_RE.match(name)
            if match:
                prefix, suffix, kind = match.groups()
                fused, shard = _FUSED[suffix]
                sizes = shards[fused]
                target = f"{prefix}{fused}.{kind}"
                offset = sum(sizes[:shard])
                rows = sizes[shard]
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            full = self._loaded_shape(target, param)
            expected_shape = (rows, *full[1:]) if match else full
            if isinstance(tensor, QuantizedWeight):
                shape: tuple[int, ...] = (tensor.out_features, tensor.in_features)
            else:
                shape = tuple(tensor.shape)
            if shape != expected_shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {shape}, expected {expected_shape}"
                )
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(target, []).append((offset, tensor))
            else:
                dense.add(target)
                (param.data[offset : offset + rows] if match else param.data).copy_(tensor)
            filled[target] = filled.get(target, 0) + (shape[0] if match else 1)
        missing = []
        for target in params:
            if target == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if target in filled_elsewhere:
                continue
            is_fused = any(f in target for f in shards)
            expected = self._loaded_shape(target, params[target])[0] if is_fused else 1
            if filled.get(target, 0) != expected:
                missing.append(target)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")
        for target, parts in quantized.items():
            self._keep_quantized(target, params[target], [w for _, w in sorted(parts)], dense)

    def _loaded_shape(self, target: str, param: nn.Parameter) -> tuple[int, ...]:
        """The shape ``target`` holds once loaded: its own (a tensor-parallel rank's share
        included), or while its storage is released (kept quantized) its shape at build."""
        return tuple(param.shape) if param.numel() else self._full_shapes[target]

    def _keep_quantized(
        self, target: str, param: nn.Parameter, parts: list[QuantizedWeight], dense: set[str]
    ) -> None:
        if target in dense:  # part of a fused weight came unquantized: dequantize the rest
            offset = 0
            for part in parts:
                param.data[offset : offset + part.out_features].copy_(part.dequantize())
                offset += part.out_features
            return
        module = self.get_submodule(target.rsplit(".", 1)[0])
        parts = [part.to(param.device) for part in parts]
        if isinstance(module, Embedding):
            module.quantized = parts[0]
            if self.config.tie_word_embeddings:
                self.lm_head.quantized = QuantizedLinear(parts)
        elif isinstance(module, Linear):
            module.quantized = QuantizedLinear(parts)
        else:
            raise ValueError(f"checkpoint tensor for {target!r}: cannot be kept quantized")
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def quantized_bytes(self) -> int:
        """Bytes of the weights held quantized (:mod:`.quantized`); 0 when none are."""
        held: dict[int, int] = {}  # by weight: a tied LM head shares the embedding's
        for m in self.modules():
            if isinstance(m, Embedding) and m.quantized is not None:
                held[id(m.quantized)] = m.quantized.nbytes
            elif isinstance(m, Linear) and m.quantized is not None:
                held.update((id(part), part.nbytes) for part in m.quantized.parts)
        return sum(held.values())

    def set_int8_max_rows(self, rows: int) -> None:
        """Inputs of up to ``rows`` rows take the integer kernel in every quantized matmul
        (:class:`.QuantizedLinear`; 0: none, the fp32 fidelity path)."""
        for m in self.modules():
            if isinstance(m, Linear) and m.quantized is not None:
                m.quantized.int8_max_rows = rows

    def drop_quantized(self) -> None:
        """Forget every quantized weight (they must be loaded again before the next forward)."""
        for module in self.modules():
            if isinstance(module, Linear | Embedding):
                module.quantized = None
