"""legato.models: Llama-family models on a paged KV cache, the sampler and the ModelRunner.

Modules (import them directly; this package imports nothing, so that importing
one submodule stays cheap):

- ``runner``: :class:`ModelRunner`, one scheduler step in, sampled tokens out;
- ``cuda_graphs``: decode steps captured as CUDA graphs, padded to captured sizes;
- ``input_batch``: the runner's persistent per-request state;
- ``sampler``: vectorised sampling with vLLM's semantics, logprobs;
- ``llama``: one model class for Llama 2/3, Mistral, Qwen2, Qwen3;
- ``phi3``: Phi-3 / Phi-4, the Llama class with fused q/k/v and gate/up tensors;
- ``layers``: linear, embedding, RMSNorm, MLP, attention;
- ``rotary``: rotary embeddings and their scalings (linear, llama3, YaRN, dynamic
  NTK, LongRoPE, GGUF ``rope_freqs``);
- ``attention_backend``: the dispatch point (torch / triton / reference);
- ``torch_ops``: vectorised plain-torch hot paths for CPU;
- ``config``, ``registry``, ``loader``: config.json, architectures, safetensors
  (or seeded random weights for a weightless model directory).
"""
