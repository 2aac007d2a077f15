"""Offline inference: ``LLM`` (batch generate, over the async engine in a thread)
and ``LLMEngine`` (vLLM's step-wise engine, synchronous in the caller's thread).

Modules: ``batch`` (``LLM``) and ``llm_engine`` (``LLMEngine``).
"""

from .batch import LLM
from .llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine"]
