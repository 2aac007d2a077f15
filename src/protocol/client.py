"""EngineClient: the protocol every legato client implements, vLLM's method for method.

Code written against vLLM's ``EngineClient`` (``vllm/engine/protocol.py``)
moves over with few changes. What this page adds is the contract in trio's
terms, which every implementation (the engine facade, the render-only
client, remote clients) keeps:

- Every ``async`` method is a checkpoint: it may be cancelled, and it yields
  to the scheduler even when it has nothing to wait for. Methods that may
  block say how long.
- Cancelling a caller is never an error. The engine stays healthy; a request
  whose consumer is cancelled is aborted and its KV-cache blocks are freed
  within one engine step. A control call (pause, sleep, reset...) whose
  message reached the engine completes there even if its caller stops waiting.
- Once the engine is dead (``errored`` is True), new requests and control
  calls raise ``dead_error`` at once, without waiting: an
  :class:`EngineDeadError` whose ``__cause__`` is the first failure. Every open
  stream raises it at its next iteration. Nothing hangs. The properties,
  ``abort`` and ``shutdown`` never raise it.
- A failure the engine can pin on one request (bad params, prompt too long,
  unknown LoRA) fails that request alone, with :class:`ValidationError` or
  :class:`EngineGenerateError`; the engine keeps serving.
- Calls come from tasks of the trio run that owns the engine; from another
  thread, go through ``trio.from_thread``.

Never imports trio or torch.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, NotRequired, Protocol, TypedDict

from .errors import EngineDeadError
from .outputs import PoolingRequestOutput, RequestOutput
from .params import LoRARequest, PoolingParams, SamplingParams


class TextPrompt(TypedDict):
    """A prompt as text; the renderer tokenizes it."""

    prompt: str
    cache_salt: NotRequired[str]  # keeps this prompt's prefix-cache blocks apart from others'


class TokensPrompt(TypedDict):
    """A prompt already tokenized; ``prompt`` is its text, if the caller has it."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt


@dataclass
class WeightTransferInitRequest:
    """vLLM's request to ``init_weight_transfer_engine``: the backend's init info."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's request to ``update_weights``: the backend's update info (legato's disk
    backend: ``{"path": "/abs/checkpoint/dir"}``)."""

    update_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamingInput:
    """One chunk of a streaming-input session (vLLM's): ``generate`` takes an async
    generator of these in place of a prompt. Each chunk runs as a request whose prompt is
    every chunk so far plus the tokens generated for the earlier ones (each request's
    last sampled token left out); every generated token reaches the session's stream.
    ``sampling_params``: this chunk's, else the ones ``generate`` was given."""

    prompt: PromptType
    sampling_params: SamplingParams | None = None
PauseModeName = Literal["abort", "wait", "keep"]
SupportedTask = Literal["generate", "embed", "classify", "score", "encode", "render"]


class OutputStream(Protocol):
    """What :meth:`EngineClient.generate` returns: an async iterator of RequestOutput that
    is also an async context manager (leaving it aborts an unfinished request)."""

    def __aiter__(self) -> OutputStream: ...

    async def __anext__(self) -> RequestOutput: ...

    async def __aenter__(self) -> OutputStream: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """What a server says about the model an engine serves."""

    name: str  # the served name (``--served-model-name``, else the model as given)
    max_model_len: int | None  # prompt + output tokens, at most (None: not known yet)
    special_tokens: Mapping[str, str]  # the tokenizer's named special tokens (bos_token ...)


class EngineClient(abc.ABC):
    """What a caller can ask of an engine. See the module docstring for the common contract."""

    # ------------------------------------------------------------- state

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """True from startup until the engine stops or dies. Never blocks, never raises."""

    @property
    @abc.abstractmethod
    def is_stopped(self) -> bool:
        """True once the engine has stopped or died. Never blocks, never raises."""

    @property
    @abc.abstractmethod
    def errored(self) -> bool:
        """True once the engine has died. Never blocks, never raises."""

    @property
    @abc.abstractmethod
    def dead_error(self) -> EngineDeadError:
        """The error every call raises once the engine is dead; ``__cause__`` is the first failure.

        Never blocks, never raises. Before death it is an EngineDeadError
        without a cause, as in vLLM; read it once ``errored`` is True.
        """

    # ------------------------------------------------------------- requests

    @abc.abstractmethod
    def generate(
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
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> OutputStream:
        """Stream one request's outputs: an async iterator of RequestOutput.

        The request is submitted when iteration starts. Each ``__anext__`` is
        a checkpoint that blocks until the engine has news for this request;
        a slow consumer never stalls the engine: news merges until taken (per
        ``sampling_params.output_kind``: DELTA joins the deltas, CUMULATIVE
        keeps the latest, FINAL_ONLY yields once). The last output has
        ``finished=True``, then the generator ends.

        Cancellation: if the consumer is cancelled, or stops iterating (break,
        an exception), the request is aborted and its KV-cache blocks are
        freed within one engine step. legato's stream is also an async context
        manager: ``async with engine.generate(...) as stream`` closes it
        deterministically, and is the safe form in trio; an abandoned stream
        is aborted when it is garbage-collected. None of this is an error to
        the engine.

        Raises, from the iteration: ValidationError (a subclass of ValueError)
        for bad params, a ``request_id`` already in flight, an unknown LoRA, or
        PromptTooLongError, before any output; EngineGenerateError if the
        request fails later while the engine stays healthy; ``dead_error`` at
        once if the engine is dead, or from the next ``__anext__`` if it dies
        mid-stream.

        ``prompt_text`` is the prompt's text when ``prompt`` is token ids;
        ``tokenization_kwargs`` are passed to the tokenizer by the renderer;
        ``priority`` orders admission under ``scheduling_policy="priority"``
        (lower first); under "fcfs" anything but 0 raises ValidationError, as
        vLLM's ValueError; ``trace_headers`` are
        accepted and ignored (no tracing); ``data_parallel_rank`` must be None
        or 0 (one engine core).
        """

    @abc.abstractmethod
    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Run a pooling request: an async iterator yielding one PoolingRequestOutput.

        Same contract as :meth:`generate` (submission, cancellation, errors);
        a task the model does not support (see :meth:`get_supported_tasks`)
        raises ValidationError.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several. A checkpoint; does not wait for the engine step.

        Ids that are unknown or already finished are ignored. A consumer still
        iterating an aborted stream gets a last output with finish_reason
        "abort"; the KV-cache blocks are freed within one engine step. Never
        raises EngineDeadError (a dead engine has nothing left to abort), so it
        is safe in cleanup code.
        """

    async def notify_kv_transfer_request_rejected(  # noqa: B027 - deliberately nothing to do
        self,
        request_id: str,
        kv_transfer_params: dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Tell the engine a KV-transfer request was rejected before admission.

        In vLLM this lets a KV connector release blocks pinned for the request.
        legato has no KV connector, so nothing is pinned: this does nothing.
        """

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:  # noqa: B027 - admits all
        """Reject up front a request of ``n`` sequences that would exceed queue limits.

        Not a checkpoint; never blocks. Servers call it before starting a
        response, while an overload can still get an HTTP status. The default
        admits everything.
        """

    # ------------------------------------------------------------- health and stats

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Return if the engine is healthy; raise ``dead_error`` at once if it is dead.

        A checkpoint; does not wait for an engine step.
        """

    @abc.abstractmethod
    async def is_tracing_enabled(self) -> bool:
        """Whether request tracing is on; legato has none, so False."""

    @abc.abstractmethod
    async def do_log_stats(self) -> None:
        """Write the stats log line now rather than at the next interval."""

    @abc.abstractmethod
    async def start_profile(self) -> None:
        """Start a profiler trace in the engine and its workers.

        Blocks until the workers have started it. Raises ValidationError if no
        ``profile_dir`` is configured.
        """

    @abc.abstractmethod
    async def stop_profile(self) -> None:
        """Stop the trace and write it under ``profile_dir``; blocks until written."""

    # ------------------------------------------------------------- caches, sleep, adapters

    @abc.abstractmethod
    async def reset_mm_cache(self) -> None:
        """Drop the multi-modal preprocessing cache; legato has none, so returns at once."""

    @abc.abstractmethod
    async def reset_encoder_cache(self) -> None:
        """Drop the multi-modal encoder-output cache; legato has none, so returns at once."""

    @abc.abstractmethod
    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop every prefix-cache block; True if the cache is now empty.

        Applied at the next step boundary, so it blocks for up to one step.
        Blocks held by running requests cannot be dropped: without
        ``reset_running_requests`` it returns False when any are held; with
        it, running requests are preempted first and recompute their KV later.
        ``reset_connector`` is accepted and ignored (no KV connector).
        """

    @abc.abstractmethod
    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None:
        """Free accelerator memory until :meth:`wake_up`; returns once asleep.

        In-flight requests are first handled as by ``pause_generation(mode=mode)``.
        Level 1 drops the KV cache and moves the weights to host memory; level 2
        drops the weights as well. New requests queue until the engine wakes.
        """

    @abc.abstractmethod
    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed; returns once restored.

        ``tags`` picks "weights" and/or "kv_cache"; None restores everything.
        """

    @abc.abstractmethod
    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep."""

    @abc.abstractmethod
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter for requests that name it from now on.

        Blocks until the workers have loaded it. True when loaded (or already
        loaded); an adapter that cannot be loaded raises ValidationError.
        """

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded. Requests already running
        through it finish through it."""
        raise _unsupported(self, "remove_lora", "this client loads no adapters")

    async def list_loras(self) -> set[int]:
        """The int ids of the loaded adapters (vLLM's method). A checkpoint."""
        raise _unsupported(self, "list_loras", "this client loads no adapters")

    def loaded_loras(self) -> list[LoRARequest]:
        """The loaded adapters, by int id: what a server serves as model names (a request
        names one by its ``lora_name``). Not a checkpoint; never blocks. The default: none."""
        return []

    # ------------------------------------------------------------- pause and resume

    @abc.abstractmethod
    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None:
        """Stop generating until :meth:`resume_generation`.

        The pause takes effect at once; new generate/encode calls wait for the
        resume. ``mode`` decides the in-flight requests' fate: "abort" ends them
        with finish_reason "abort" (their consumers get a last output); "wait"
        lets them finish and returns when they have, so it may block for as long
        as the longest one (cancelling the caller stops the wait, not the
        pause); "keep" freezes them, KV cache and all, until the resume.
        ``wait_for_inflight_requests=True`` is vLLM's older spelling of
        ``mode="wait"``. ``clear_cache`` resets the prefix cache once the
        in-flight requests are gone (modes "abort" and "wait").
        """

    @abc.abstractmethod
    async def resume_generation(self) -> None:
        """End a pause: frozen requests continue, waiting calls proceed. No-op if not paused."""

    @abc.abstractmethod
    async def is_paused(self) -> bool:
        """Whether generation is paused."""

    # ------------------------------------------------------------- lifetime

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the engine to stop. Not a checkpoint; never blocks; idempotent.

        The ``async with`` that owns the engine does the waiting: it gives the
        actors and worker processes ``timeout`` seconds (None: the configured
        default) to finish, then cancels and reaps them. Open streams and later
        calls raise EngineDeadError saying the engine was shut down.
        """

    # ------------------------------------------------------------- optional

    def model_info(self) -> ModelInfo:
        """The served model's name, context limit and special tokens."""
        raise _unsupported(self, "model_info", "this client serves no model")

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` with the base model's tokenizer. A checkpoint."""
        raise _unsupported(self, "tokenize", "this client has no tokenizer")

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; ValidationError (field ``prompt_token_ids``) for ids
        outside the vocabulary. A checkpoint."""
        raise _unsupported(self, "detokenize", "this client has no tokenizer")

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included. Not a checkpoint; cheap."""
        raise _unsupported(self, "token_text", "this client has no tokenizer")

    async def embedding_size(self) -> int:
        """The length of the model's embedding vectors. A checkpoint."""
        raise _unsupported(self, "embedding_size", "this client serves no model")

    def metrics_text(self) -> bytes:
        """The engine's metrics in Prometheus' text format."""
        raise _unsupported(self, "metrics_text", "this client keeps no metrics")

    async def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Chat messages as a ready prompt ``{"prompt", "prompt_token_ids"}`` for
        :meth:`generate`, rendered with the chat template (``chat_template``, else the
        tokenizer's); ``tools`` and ``template_kwargs`` reach the template. A checkpoint;
        bad messages or a failing template raise ValidationError naming the field."""
        raise _unsupported(self, "render_chat_prompt", "this client has no chat template")

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """The tokenizer requests are rendered with (a transformers tokenizer); for
        ``lora_request``, the one that adapter's requests are rendered with."""
        raise _unsupported(self, "get_tokenizer", "this client has no tokenizer")

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        """The tasks the loaded model serves, e.g. ("generate",)."""
        raise _unsupported(self, "get_supported_tasks", "this client does not report its tasks")

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every model worker; one result per worker.

        Arguments and results cross the process boundary as msgpack-native
        values (WireError otherwise). Blocks until every worker has answered,
        or raises TimeoutError after ``timeout`` seconds (vLLM's parameter; a
        trio caller may as well use ``trio.fail_after``). A worker method that
        raises fails this call with RuntimeError carrying its message; the
        engine keeps serving.
        """
        raise _unsupported(self, "collective_rpc", "this client has no model workers")

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        """Change the data-parallel size of an elastic expert-parallel deployment."""
        raise _unsupported(self, "scale_elastic_ep", "legato runs a single engine core")

    async def init_weight_transfer_engine(self, init_request: Any) -> None:
        """Set up the channel a trainer pushes new weights through (RL training)."""
        raise _unsupported(self, "init_weight_transfer_engine", _NO_WEIGHT_TRANSFER)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Begin a weight update; batches follow through :meth:`update_weights`."""
        raise _unsupported(self, "start_weight_update", _NO_WEIGHT_TRANSFER)

    async def update_weights(self, request: Any) -> None:
        """Receive one batch of new weights."""
        raise _unsupported(self, "update_weights", _NO_WEIGHT_TRANSFER)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Complete a weight update, recording its version if given."""
        raise _unsupported(self, "finish_weight_update", _NO_WEIGHT_TRANSFER)

    async def update_weight_version(self, new_version: str) -> None:
        """Record a weight version without changing the weights."""
        raise _unsupported(self, "update_weight_version", _NO_WEIGHT_TRANSFER)

    async def get_weight_version(self) -> str:
        """The version of the weights in use."""
        raise _unsupported(self, "get_weight_version", _NO_WEIGHT_TRANSFER)


_NO_WEIGHT_TRANSFER = "weight transfer from a trainer is not supported"


def _unsupported(client: EngineClient, method: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{type(client).__name__}.{method}: {why}")
