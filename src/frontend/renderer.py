"""The renderer: prompt (text | chat messages | token ids) -> validated engine requests.

``Renderer`` is plain synchronous code, run by the engine's front end
(``legato.actors.frontend``) in the caller's task, by ``LLMEngine`` and by
``RenderOnlyClient`` (which has no model). Every rule it enforces raises
``ValidationError`` (a ValueError) naming the field, and fails only that
request. Never imports trio or torch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from ..protocol.errors import PromptTooLongError, ValidationError
from ..protocol.inputs import EngineCoreRequest
from ..protocol.messages import EngineRequest, RunnerSamplingParams
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams
from ..protocol.request_ids import child_id
from .vllm_renderer import ChatParams, Conversation, TokenizeParams, VllmRendererCalls

if TYPE_CHECKING:
    from ..structured.engine import EngineGrammars

PromptType = str | Mapping[str, Any] | Sequence[int]


@dataclass
class RenderedPrompt:
    """A prompt as text (when known) and token ids, and the prefix-cache salt it asks for."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


_NO_EMBEDS = "embedding prompts are not supported: legato's models take token ids"

TOKENIZATION_KWARGS: dict[str, type] = {
    "add_special_tokens": bool,
    "truncation": bool,
    "max_length": int,
}
"""The ``tokenization_kwargs`` a text prompt may carry, and their types."""


def check_tokenization_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` checked against :data:`TOKENIZATION_KWARGS`; ValidationError otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValidationError("tokenization_kwargs", f"must be a dict, got {type(kwargs).__name__}")
    for key, value in kwargs.items():
        kind = TOKENIZATION_KWARGS.get(key)
        if kind is None:
            raise ValidationError(
                "tokenization_kwargs",
                f"{key!r} is not supported (supported: {', '.join(TOKENIZATION_KWARGS)})",
            )
        if type(value) is not kind or (isinstance(value, int) and kind is int and value < 1):
            raise ValidationError(
                f"tokenization_kwargs.{key}",
                f"must be a {'positive ' * (kind is int)}{kind.__name__}, got {value!r}",
            )
    if kwargs.get("truncation") and "max_length" not in kwargs:
        raise ValidationError("tokenization_kwargs.max_length", "is needed with truncation=True")
    return dict(kwargs)


def _cache_salt(prompt: Mapping[str, Any]) -> str | None:
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValidationError("cache_salt", f"must be a non-empty string, got {salt!r}")
    return salt


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "chat_template"}
)


def template_kwargs_of(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables; names the renderer sets are refused."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS or not str(key).isidentifier():
            raise ValidationError(
                f"chat_template_kwargs.{key}", "cannot be set through chat_template_kwargs"
            )
    return dict(kwargs)


class Renderer(VllmRendererCalls):
    """Turns caller prompts into ``EngineRequest``s for one model; vLLM's
    ``BaseRenderer`` calls too (``get_tokenizer``, ``render_cmpl``, ``render_chat``
    with ``chat_params``: :mod:`legato.frontend.vllm_renderer`).

    ``max_model_len`` and ``vocab_size`` come from the loaded model; without a
    model (render-only) pass the tokenizer's figures.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_logprobs: int = 20,
        grammars: EngineGrammars | None = None,
    ) -> None:
        """``grammars``: structured outputs, compiled at admission (None: render-only)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The first EOS id ends a request as EOS; any others (Llama 3 lists several in
        # generation_config.json) are added to each request's stop ids, as vLLM does.
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_ids = [int(t) for t in eos_token_ids[1:]]
        self.max_logprobs = max_logprobs
        self.grammars = grammars

    # ------------------------------------------------------------ prompts

    def render_prompt(
        self,
        prompt: PromptType | EngineCoreRequest,
        *,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        prompt_text: str | None = None,
    ) -> RenderedPrompt:
        """Tokenize text or check token ids. Raises ValidationError.

        A dict prompt may carry ``cache_salt`` (a non-empty string): its
        prefix-cache blocks are then shared only with prompts of the same
        salt. ``tokenization_kwargs`` (see :data:`TOKENIZATION_KWARGS`) apply
        to text prompts. ``prompt_text`` is the text the outputs report as
        the prompt (for a prompt given as token ids).
        """
        kwargs = check_tokenization_kwargs(tokenization_kwargs)
        if prompt_text is not None and not isinstance(prompt_text, str):
            raise ValidationError(
                "prompt_text", f"must be a string, got {type(prompt_text).__name__}"
            )
        rendered = self._render(prompt, kwargs)
        if prompt_text is not None:
            rendered.text = prompt_text
        return rendered

    def _render(
        self, prompt: PromptType | EngineCoreRequest, kwargs: dict[str, Any]
    ) -> RenderedPrompt:
        if isinstance(prompt, str):
            return RenderedPrompt(prompt, self.encode(prompt, **kwargs))
        if isinstance(prompt, EngineCoreRequest):  # processed already: checked again here
            if prompt.prompt_embeds is not None:
                raise ValidationError("prompt_embeds", _NO_EMBEDS)
            if prompt.mm_features:
                raise ValidationError("mm_features", "multimodal inputs are not supported")
            salt = _cache_salt({"cache_salt": prompt.cache_salt} if prompt.cache_salt else {})
            return RenderedPrompt(prompt.prompt, self._check_ids(prompt.prompt_token_ids), salt)
        if isinstance(prompt, Mapping):
            if "prompt_embeds" in prompt:
                raise ValidationError("prompt_embeds", _NO_EMBEDS)
            if "encoder_prompt" in prompt or "decoder_prompt" in prompt:
                raise ValidationError(
                    "prompt", "encoder/decoder prompts: legato serves decoder-only models"
                )
            salt = _cache_salt(prompt)
            if "prompt_token_ids" in prompt:
                ids = self._check_ids(prompt["prompt_token_ids"])
                return RenderedPrompt(prompt.get("prompt"), ids, salt)
            if "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise ValidationError("prompt", f"must be a string, got {type(text).__name__}")
                return RenderedPrompt(text, self.encode(text, **kwargs), salt)
            raise ValidationError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            return RenderedPrompt(None, self._check_ids(prompt))
        raise ValidationError("prompt", f"unsupported prompt type {type(prompt).__name__}")

    @overload
    def render_chat(
        self,
        conversations: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...
    @overload
    def render_chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        chat_params: ChatParams,
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
    ) -> tuple[list[Conversation], list[dict[str, Any]]]: ...
    def render_chat(
        self,
        conversations: Any,
        chat_params: ChatParams | None = None,
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str | tuple[list[Conversation], list[dict[str, Any]]]:
        """Two forms. With ``chat_params``, vLLM's ``BaseRenderer.render_chat(conversations,
        chat_params, tok_params, *, prompt_extras)``: a list of conversations ->
        (conversations, engine prompts), see :meth:`render_vllm_chat`. Without, legato's:
        one conversation (its messages) -> its text, see :meth:`render_chat_text`.
        The first parameter has vLLM's name, ``conversations``, in both forms."""
        if chat_params is not None:
            return self.render_vllm_chat(
                conversations, chat_params, tok_params, prompt_extras=prompt_extras
            )
        return self.render_chat_text(
            conversations,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    def render_chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Chat messages rendered with the tokenizer's chat template (or ``chat_template``);
        ``tools`` and ``template_kwargs`` (``chat_template_kwargs``) reach the template."""
        if not messages:
            raise ValidationError("messages", "must not be empty")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValidationError(f"messages[{i}]", "each message needs a string 'role'")
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise ValidationError(
                    f"messages[{i}].content", "must be a string or a list of parts"
                )
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(msg) for msg in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **template_kwargs_of(template_kwargs),
            )
        except ValidationError:
            raise
        except Exception as exc:
            raise ValidationError("messages", f"chat template failed: {exc}") from exc
        return str(text)

    def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Chat messages as a ready prompt ``{"prompt", "prompt_token_ids"}``.

        The template writes its own special tokens (BOS included), so the text
        is tokenized without adding more.
        """
        text = self.render_chat_text(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``bad_words`` as token sequences, as vLLM makes them: each word (stripped on the
        left) tokenized alone, and with a leading space when that gives a different
        first token and as many tokens. ValidationError for an id outside the vocabulary."""
        sequences: list[list[int]] = []
        for word in params.bad_words or ():
            plain: list[int] | None = None
            for prefix in ("", " "):
                ids = self.encode(prefix + word.lstrip(), add_special_tokens=False)
                if not ids:
                    continue
                if plain is None:
                    plain = ids
                    sequences.append(ids)
                elif ids[0] != plain[0] and len(ids) == len(plain):
                    sequences.append(ids)
        if any(t >= self.vocab_size for ids in sequences for t in ids):
            raise ValidationError("bad_words", "a word tokenizes outside the vocabulary")
        return sequences

    def encode(self, text: str, *, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text``; ``kwargs`` are checked ``TOKENIZATION_KWARGS``."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = self._check_ids(token_ids, allow_empty=True)
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _check_ids(self, ids: object, *, allow_empty: bool = False) -> list[int]:
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
            raise ValidationError("prompt_token_ids", "must be a list of integers")
        out: list[int] = []
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValidationError("prompt_token_ids", f"must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValidationError(
                    "prompt_token_ids",
                    f"token id {token_id} is outside the vocabulary ({self.vocab_size})",
                )
            out.append(token_id)
        if not out and not allow_empty:
            raise ValidationError("prompt", "must not be empty")
        return out

    # ----------------------------------------------------------- requests

    def make_requests(
        self,
        request_id: str,
        rendered: RenderedPrompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EngineRequest]:
        """Validate against the model and fan out n>1 into children, each built whole
        (nothing is set on them afterwards).

        A single request keeps the caller's id; children are ``child_id(i, id)``
        with ``parent_id`` set, and seed ``seed + i`` when a seed is given.
        """
        if not isinstance(params, SamplingParams):
            raise ValidationError(
                "sampling_params", f"must be SamplingParams, got {type(params).__name__}"
            )
        token_ids = rendered.token_ids
        if not token_ids:
            raise ValidationError("prompt", "must not be empty")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        params.validate_against_vocab(self.vocab_size)  # ValidationError naming the field
        for name, value in (
            ("logprobs", params.logprobs),
            ("prompt_logprobs", params.prompt_logprobs),
        ):
            # vLLM's rule: -1 is the whole vocabulary, allowed only with max_logprobs=-1.
            wanted = self.vocab_size if value == -1 else value
            if wanted is not None and self.max_logprobs != -1 and wanted > self.max_logprobs:
                raise ValidationError(
                    name,
                    f"at most {self.max_logprobs} are supported, got {value}"
                    + (f" (the whole vocabulary, {self.vocab_size})" if value == -1 else ""),
                )
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise PromptTooLongError(
                "prompt",
                f"{len(token_ids)} prompt tokens leave no room within max_model_len={self.max_model_len}",
            )
        if params.max_tokens is None or params.max_tokens > room:
            # As vLLM: output is capped at max_model_len (the request then ends with
            # finish_reason "length"); only a prompt that leaves no room is refused.
            params = params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
        if self.extra_eos_ids and not params.ignore_eos:
            stop_ids = list(params.stop_token_ids or [])
            stop_ids += [t for t in self.extra_eos_ids if t not in stop_ids]
            params = params.clone(stop_token_ids=stop_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        salt = rendered.cache_salt
        lora_name = None if lora_request is None else lora_request.lora_name
        # What the model runner samples with: one instance for the request and its children.
        runner_params = RunnerSamplingParams.of(params, self.bad_words_token_ids(params))
        if params.n == 1:
            return [
                EngineRequest(
                    request_id,
                    token_ids,
                    params,
                    arrival,
                    priority,
                    self.eos_token_id,
                    lora_name,
                    cache_salt=salt,
                    lora_request=lora_request,
                    pooling_params=pooling_params,
                    runner_params=runner_params,
                )
            ]
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            child = params.clone(n=1, best_of=None, seed=seed)
            children.append(
                EngineRequest(
                    child_id(index, request_id),
                    token_ids,
                    child,
                    arrival,
                    priority,
                    self.eos_token_id,
                    lora_name,
                    cache_salt=salt,
                    parent_id=request_id,
                    index=index,
                    lora_request=lora_request,
                    pooling_params=pooling_params,
                    runner_params=runner_params,
                )
            )
        return children
