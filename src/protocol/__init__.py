"""The contracts: parameters, outputs, errors, messages, the wire codec and EngineClient.

Nothing in this package imports torch or trio.
"""

from .client import EngineClient, PromptType, TextPrompt, TokensPrompt
from .errors import (
    EngineBusyError,
    EngineDeadError,
    EngineGenerateError,
    EngineStartupError,
    LegatoError,
    PromptTooLongError,
    ValidationError,
)
from .outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from .params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from .wire import WireError, decode, encode

__all__ = [
    "CompletionOutput",
    "EngineClient",
    "EngineDeadError",
    "EngineBusyError",
    "EngineGenerateError",
    "EngineStartupError",
    "LegatoError",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptTooLongError",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "ValidationError",
    "WireError",
    "decode",
    "encode",
]
