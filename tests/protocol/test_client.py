"""EngineClient: the abstract surface, and the optional methods' clear refusals."""

from __future__ import annotations

import ast
import inspect
from collections.abc import AsyncGenerator, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

import legato.protocol.client as client_module
from legato.protocol import (
    EngineClient,
    EngineDeadError,
    LoRARequest,
    PoolingParams,
    SamplingParams,
)
from legato.protocol.client import PauseModeName, PromptType
from legato.protocol.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput

REQUIRED = {
    "is_running",
    "is_stopped",
    "errored",
    "dead_error",
    "generate",
    "encode",
    "abort",
    "check_health",
    "is_tracing_enabled",
    "do_log_stats",
    "start_profile",
    "stop_profile",
    "reset_mm_cache",
    "reset_encoder_cache",
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "is_sleeping",
    "add_lora",
    "pause_generation",
    "resume_generation",
    "is_paused",
    "shutdown",
}


class MinimalClient(EngineClient):
    """Implements only what is abstract."""

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        yield RequestOutput(
            request_id, str(prompt), None, None, [CompletionOutput(0, "!", [1])], True
        )

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        raise NotImplementedError
        yield

    async def abort(self, request_id: str | Iterable[str]) -> None: ...
    async def check_health(self) -> None: ...
    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None: ...
    async def start_profile(self) -> None: ...
    async def stop_profile(self) -> None: ...
    async def reset_mm_cache(self) -> None: ...
    async def reset_encoder_cache(self) -> None: ...
    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True

    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None: ...
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return True

    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None: ...
    async def resume_generation(self) -> None: ...
    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None: ...


def test_abstract_surface_is_vllms() -> None:
    assert EngineClient.__abstractmethods__ == REQUIRED
    with pytest.raises(TypeError, match="abstract"):
        EngineClient()  # type: ignore[abstract]


def test_a_partial_subclass_cannot_be_instantiated() -> None:
    class Partial(EngineClient):
        async def abort(self, request_id: str | Iterable[str]) -> None: ...

    with pytest.raises(TypeError, match="generate"):
        Partial()  # type: ignore[abstract]


async def test_minimal_subclass_streams() -> None:
    engine = MinimalClient()
    outputs = [out async for out in engine.generate("hi", SamplingParams(), "r1")]
    assert [o.outputs[0].text for o in outputs] == ["!"]
    assert outputs[-1].finished


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("get_supported_tasks", ()),
        ("collective_rpc", ("ping",)),
        ("scale_elastic_ep", (2,)),
        ("init_weight_transfer_engine", ({"backend": "nccl"},)),
        ("start_weight_update", ()),
        ("update_weights", ({},)),
        ("finish_weight_update", ("v2",)),
        ("update_weight_version", ("v2",)),
        ("get_weight_version", ()),
        ("remove_lora", (1,)),
        ("list_loras", ()),
        ("tokenize", ("hi",)),
        ("detokenize", ([1],)),
        ("embedding_size", ()),
        ("render_chat_prompt", ([{"role": "user", "content": "hi"}],)),
    ],
)
async def test_optional_methods_refuse_clearly(method: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(NotImplementedError, match=rf"^MinimalClient\.{method}: .+"):
        await getattr(MinimalClient(), method)(*args)


async def test_defaults_that_succeed() -> None:
    engine = MinimalClient()
    engine.check_admission(n=4, request_id="r")
    await engine.notify_kv_transfer_request_rejected("r", {}, data_parallel_rank=None)
    assert engine.loaded_loras() == []  # a client without adapters serves none


def test_every_method_says_its_contract() -> None:
    for name, member in inspect.getmembers(EngineClient):
        if not name.startswith("_"):
            assert inspect.getdoc(member), f"EngineClient.{name} has no docstring"


def test_never_imports_trio_or_torch() -> None:
    tree = ast.parse(Path(client_module.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "torch", "anyio"}
