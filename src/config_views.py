"""vLLM's config getters, written once for every trio ``EngineClient`` here.

``VllmConfigViews`` derives ``model_config``, ``decoding_config`` and the async
``get_*_config`` calls from one ``vllm_config`` property, which each client
(``AsyncEngine``, ``RenderOnlyClient``) defines. The async getters are
checkpoints, as trio asks of every async call.

A leaf module: it imports trio and ``legato.vllm_config``, never the engine,
the actors, models or torch. (Not in ``protocol/``: the protocol imports no trio.)
"""

from __future__ import annotations

import abc

import trio

from .vllm_config import DecodingConfig, ModelConfig, VllmConfig


class VllmConfigViews(abc.ABC):
    """Mixin: the config views of a client that defines ``vllm_config``."""

    @property
    @abc.abstractmethod
    def vllm_config(self) -> VllmConfig:
        """vLLM's read-only view of the client's configuration (legato.vllm_config)."""

    @property
    def model_config(self) -> ModelConfig:
        """``vllm_config.model_config``."""
        return self.vllm_config.model_config

    @property
    def decoding_config(self) -> DecodingConfig:
        """``vllm_config.decoding_config`` (structured outputs)."""
        return self.vllm_config.decoding_config

    async def get_vllm_config(self) -> VllmConfig:
        await trio.lowlevel.checkpoint()
        return self.vllm_config

    async def get_model_config(self) -> ModelConfig:
        await trio.lowlevel.checkpoint()
        return self.model_config

    async def get_decoding_config(self) -> DecodingConfig:
        await trio.lowlevel.checkpoint()
        return self.decoding_config
