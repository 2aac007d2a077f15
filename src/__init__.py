"""legato: a trio-native LLM inference and serving engine.

Public names are re-exported here; internals are free to move.
"""

from .protocol import (
    CompletionOutput,
    EngineDeadError,
    EngineGenerateError,
    EngineStartupError,
    Logprob,
    PoolingParams,
    PoolingRequestOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)

__version__ = "0.1.0"

__all__ = [
    "CompletionOutput",
    "EngineDeadError",
    "EngineGenerateError",
    "EngineStartupError",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
