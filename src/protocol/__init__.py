"""The contracts: parameters, outputs, errors, messages, the wire codec and EngineClient.

Nothing in this package imports torch or trio.
"""

from .errors import (
    EngineDeadError,
    EngineGenerateError,
    EngineStartupError,
    LegatoError,
    PromptTooLongError,
    ValidationError,
)
from .outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from .params import PoolingParams, RequestOutputKind, SamplingParams
from .wire import WireError, decode, encode

__all__ = [
    "CompletionOutput",
    "EngineDeadError",
    "EngineGenerateError",
    "EngineStartupError",
    "LegatoError",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptTooLongError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ValidationError",
    "WireError",
    "decode",
    "encode",
]
