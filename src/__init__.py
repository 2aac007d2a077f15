"""legato: a trio-native LLM inference and serving engine.

Public names are re-exported here; internals are free to move.
"""

from .config import EngineConfig
from .engine import AsyncEngine, RequestStream, open_engine
from .frontend.vllm_renderer import ChatParams, TokenizeParams
from .llm import LLM, LLMEngine
from .protocol import (
    CompletionOutput,
    EngineBusyError,
    EngineClient,
    EngineDeadError,
    EngineGenerateError,
    EngineStartupError,
    Logprob,
    LoRARequest,
    PoolingParams,
    PoolingRequestOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from .protocol.client import WeightTransferInitRequest, WeightTransferUpdateRequest
from .protocol.errors import ValidationError
from .render_only import RenderOnlyClient
from .supervise import open_supervised_engine
from .vllm_config import AsyncEngineArgs, EngineArgs, VllmConfig

# vLLM's class names, for code that imports them: the same trio engine (built by
# ``open_engine`` / ``AsyncEngine.from_engine_args`` inside ``async with``).
AsyncLLM = AsyncEngine
AsyncLLMEngine = AsyncEngine

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "ChatParams",
    "CompletionOutput",
    "EngineClient",
    "EngineArgs",
    "EngineConfig",
    "EngineDeadError",
    "EngineBusyError",
    "EngineGenerateError",
    "EngineStartupError",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RenderOnlyClient",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
    "TokenizeParams",
    "ValidationError",
    "VllmConfig",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
    "__version__",
    "open_engine",
    "open_supervised_engine",
]
