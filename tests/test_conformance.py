"""legato against vLLM's five engine classes, member by member (issue 29).

The rows are ../shared/reviews/conformance.md's 205, written out as data: vLLM's
member, legato's counterpart, the signature vLLM code calls it with, and the
verdict. The test checks every verdict against the code:

- SAME: the counterpart exists, is the same kind of member (property, coroutine,
  classmethod...) and accepts every call vLLM's signature accepts (the same
  positional order; legato's extra parameters optional).
- DIFFER: an intended or pending difference, ``why`` says which. With DIFFER_SIG the
  signature is the difference and must still be incompatible (so a fix shows up
  here); with DIFFER the difference is behaviour, and the signature, if given,
  must be compatible.
- MISSING: the counterpart named must still be absent.
- NIE: still the protocol's NotImplementedError default, as vLLM's.
- NA: vLLM transport or compile plumbing with no meaning here; not checked.

A behaviour row names the test that proves it (``test:path::name``). When a row's
verdict changes, change it here and in the README's "Coming from vLLM".
``python tests/test_conformance.py`` prints the tally.
"""

from __future__ import annotations

import importlib
import inspect
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

import legato
from legato import LLMEngine, RenderOnlyClient
from legato.engine import AsyncEngine, open_engine
from legato.protocol.client import EngineClient

Verdict = Literal["same", "differ", "differ-sig", "missing", "nie", "n/a"]
SAME: Verdict = "same"
DIFFER: Verdict = "differ"  # behaviour differs; the signature (if given) is compatible
DIFFER_SIG: Verdict = "differ-sig"  # the signature itself differs
MISSING: Verdict = "missing"
NIE: Verdict = "nie"
NA: Verdict = "n/a"

# Which object a target names: lower case an instance, upper case the class.
OWNERS = {
    "ro": "a RenderOnlyClient",
    "RO": "RenderOnlyClient",
    "eng": "a started AsyncEngine",
    "ENG": "AsyncEngine",
    "abc": "EngineClient (the protocol's defaults)",
    "llm": "an LLMEngine",
    "LLM": "LLMEngine",
}


@dataclass(frozen=True)
class Row:
    group: str  # 000 LaunchEngineClient, 001 EngineClient, 002 LLMEngine, 003 AsyncLLM, 004 MQ, X
    number: int
    member: str
    # "owner.name", "mod:module:name", "test:path::name", or None (nothing to check)
    target: str | None
    # "attr", "prop", "method", "async", "agen" (a stream), "cls" (classmethod), "type",
    # "behaviour"
    kind: str
    vllm: str | None  # vLLM's signature as called, e.g. "(request_id, internal=False)"
    verdict: Verdict
    why: str = ""


def r(group: str, number: int, member: str, target: str | None, kind: str, vllm: str | None,
      verdict: Verdict, why: str = "") -> Row:  # fmt: skip
    return Row(group, number, member, target, kind, vllm, verdict, why)


PROFILE = "()"
GENERATE_V1 = (
    "(prompt, sampling_params, request_id, *, prompt_text=None, lora_request=None,"
    " tokenization_kwargs=None, trace_headers=None, priority=0, data_parallel_rank=None,"
    " reasoning_ended=None)"
)
ENCODE_V1 = (
    "(prompt, pooling_params, request_id, lora_request=None, trace_headers=None, priority=0,"
    " tokenization_kwargs=None, reasoning_ended=None)"
)
GENERATE_V0 = (
    "(prompt, sampling_params, request_id, lora_request=None, trace_headers=None,"
    " prompt_adapter_request=None, priority=0)"
)
PAUSE = "(*, mode='abort', wait_for_inflight_requests=None, clear_cache=True)"
RESET_PREFIX = "(reset_running_requests=False, reset_connector=False)"
RENDERER = (
    "vLLM's BaseRenderer calls: get_tokenizer, render_cmpl, render_chat(conversations,"
    " ChatParams, TokenizeParams) -> engine prompts generate takes, the mm cache as null"
    " objects (tests/frontend/test_vllm_renderer.py); render_prompt stays legato's"
    " (vLLM's is an internal step); embeds / padding refused"
)
WEIGHTS = (
    "vLLM's disk backend (a local checkpoint, every rank, between steps: "
    "tests/engine/test_weight_updates.py); its NCCL / IPC transports are refused by name"
)

ROWS: list[Row] = [
    # ---- 000 vLLM LaunchEngineClient -> RenderOnlyClient
    r("000", 1, "__init__", "RO.__init__", "method", "(vllm_config)", SAME),
    r("000", 2, "vllm_config", "ro.vllm_config", "attr", None, SAME),
    r("000", 3, "model_config", "ro.model_config", "attr", None, SAME),
    r("000", 4, "renderer", "ro.renderer.render_cmpl", "method",
      "(prompts, tok_params=None, *, prompt_extras=None)", SAME, RENDERER),
    r("000", 5, "io_processor", "ro.io_processor", "attr", None, SAME),
    r("000", 6, "input_processor", "ro.input_processor", "attr", None, SAME),
    r("000", 7, "from_vllm_config", "RO.from_vllm_config", "cls", "(vllm_config)", SAME),
    r("000", 8, "get_supported_tasks", "ro.get_supported_tasks", "async", "()", SAME),
    r("000", 9, "generate", "ro.generate", "agen", GENERATE_V1, SAME),
    r("000", 10, "abort", "ro.abort", "async", "(request_id, internal=False)", SAME),
    r("000", 11, "pause_generation", "ro.pause_generation", "async", PAUSE, SAME),
    r("000", 12, "resume_generation", "ro.resume_generation", "async", "()", SAME),
    r("000", 13, "is_paused", "ro.is_paused", "async", "()", SAME),
    r("000", 14, "shutdown", "ro.shutdown", "method", "(timeout=None)", SAME),
    r("000", 15, "encode", "ro.encode", "agen", ENCODE_V1, SAME),
    r("000", 16, "is_tracing_enabled", "ro.is_tracing_enabled", "async", "()", SAME),
    r("000", 17, "do_log_stats", "ro.do_log_stats", "async", "()", SAME),
    r("000", 18, "check_health", "ro.check_health", "async", "()", SAME),
    r("000", 19, "start_profile", "ro.start_profile", "async", PROFILE, SAME),
    r("000", 20, "stop_profile", "ro.stop_profile", "async", PROFILE, SAME),
    r("000", 21, "reset_mm_cache", "ro.reset_mm_cache", "async", "()", SAME),
    r("000", 22, "reset_prefix_cache", "ro.reset_prefix_cache", "async", RESET_PREFIX, SAME),
    r("000", 23, "reset_encoder_cache", "ro.reset_encoder_cache", "async", "()", SAME),
    r("000", 24, "sleep", "ro.sleep", "async", "(level=1, mode='abort')", SAME),
    r("000", 25, "wake_up", "ro.wake_up", "async", "(tags=None)", SAME),
    r("000", 26, "is_sleeping", "ro.is_sleeping", "async", "()", SAME),
    r("000", 27, "add_lora", "ro.add_lora", "async", "(lora_request)", SAME),
    r("000", 28, "is_running", "RO.is_running", "prop", None, SAME),
    r("000", 29, "is_stopped", "RO.is_stopped", "prop", None, SAME),
    r("000", 30, "errored", "RO.errored", "prop", None, SAME),
    r("000", 31, "dead_error", "RO.dead_error", "prop", None, SAME),
    # ---- 001 vLLM EngineClient protocol -> EngineClient ABC + AsyncEngine
    r("001", 1, "vllm_config", "eng.vllm_config", "attr", None, SAME),
    r("001", 2, "model_config", "eng.model_config", "attr", None, SAME),
    r("001", 3, "renderer", "eng.renderer.render_chat", "method",
      "(conversations, chat_params, tok_params=None, *, prompt_extras=None)", SAME, RENDERER),
    r("001", 4, "input_processor", "eng.input_processor", "attr", None, SAME),
    r("001", 5, "is_running", "ENG.is_running", "prop", None, SAME),
    r("001", 6, "is_stopped", "ENG.is_stopped", "prop", None, SAME),
    r("001", 7, "errored", "ENG.errored", "prop", None, SAME),
    r("001", 8, "dead_error", "ENG.dead_error", "prop", None, SAME),
    r("001", 9, "generate", "eng.generate",
      "agen", GENERATE_V1[:-1] + ", reasoning_parser_kwargs=None)", SAME,
      "embeds prompts refused (ValueError) as vLLM refuses them without enable_prompt_embeds, which EngineArgs refuses by name"),
    r("001", 10, "encode", "eng.encode", "agen", ENCODE_V1, SAME,
      "serves 'embed'; a task not in get_supported_tasks is a ValueError, as vLLM's"),
    r("001", 11, "abort", "eng.abort", "async", "(request_id)", SAME),
    r("001", 12, "notify_kv_transfer_request_rejected", "eng.notify_kv_transfer_request_rejected",
      "async", "(request_id, kv_transfer_params)", SAME),
    r("001", 13, "is_tracing_enabled", "eng.is_tracing_enabled", "async", "()", SAME),
    r("001", 14, "do_log_stats", "eng.do_log_stats", "async", "()", SAME),
    r("001", 15, "check_health", "eng.check_health", "async", "()", SAME),
    r("001", 16, "start_profile", "eng.start_profile", "async", PROFILE, SAME),
    r("001", 17, "stop_profile", "eng.stop_profile", "async", PROFILE, SAME),
    r("001", 18, "reset_mm_cache", "eng.reset_mm_cache", "async", "()", SAME),
    r("001", 19, "reset_encoder_cache", "eng.reset_encoder_cache", "async", "()", SAME),
    r("001", 20, "reset_prefix_cache", "eng.reset_prefix_cache", "async", RESET_PREFIX, SAME),
    r("001", 21, "sleep", "eng.sleep", "async", "(level=1, mode='abort')", SAME),
    r("001", 22, "wake_up", "eng.wake_up", "async", "(tags=None)", SAME),
    r("001", 23, "is_sleeping", "eng.is_sleeping", "async", "()", SAME),
    r("001", 24, "add_lora", "eng.add_lora", "async", "(lora_request)", SAME),
    r("001", 25, "pause_generation", "eng.pause_generation", "async", PAUSE, SAME),
    r("001", 26, "resume_generation", "eng.resume_generation", "async", "()", SAME),
    r("001", 27, "is_paused", "eng.is_paused", "async", "()", SAME),
    r("001", 28, "shutdown", "eng.shutdown", "method", "(timeout=None)", SAME),
    r("001", 29, "scale_elastic_ep", "eng.scale_elastic_ep", "async",
      "(new_data_parallel_size, drain_timeout=300)", NIE),
    r("001", 30, "collective_rpc", "eng.collective_rpc", "async",
      "(method, timeout=None, args=(), kwargs=None)", SAME,
      "every rank's result in rank order, vLLM's RuntimeError / TimeoutError (tests/actors/"
      "test_tensor_parallel_executor.py); the method is a name, as the protocol types it"),
    r("001", 31, "get_supported_tasks", "eng.get_supported_tasks", "async", "()", SAME),
    r("001", 32, "init_weight_transfer_engine", "eng.init_weight_transfer_engine", "async",
      "(init_request)", SAME, WEIGHTS),
    r("001", 33, "start_weight_update", "eng.start_weight_update", "async",
      "(is_checkpoint_format=True)", SAME, WEIGHTS),
    r("001", 34, "update_weights", "eng.update_weights", "async", "(request)", SAME, WEIGHTS),
    r("001", 35, "finish_weight_update", "eng.finish_weight_update", "async", "()", SAME,
      WEIGHTS),
    r("001", 36, "StreamingInput", "mod:legato.protocol.client:StreamingInput", "type", None,
      SAME),
    # ---- 002 vLLM LLMEngine (v1) -> legato LLMEngine
    r("002", 1, "__init__", "LLM.__init__", "method", "(vllm_config, executor_class, log_stats)",
      SAME),
    r("002", 2, "vllm_config / model_config / observability_config", "llm.vllm_config", "attr",
      None, SAME),
    r("002", 3, "log_stats", "llm.log_stats", "attr", None, SAME),
    r("002", 4, "dp_group / external_launcher_dp", "llm.dp_group", "attr", None, SAME),
    r("002", 5, "renderer", "llm.renderer.get_tokenizer", "method", "()", SAME, RENDERER),
    r("002", 6, "input_processor", "llm.input_processor", "attr", None, SAME),
    r("002", 7, "output_processor", "llm.processor", "attr", None, DIFFER,
      "named processor; has_unfinished_requests / get_num_unfinished_requests match, but "
      "add_request(request_id, prompt, ids, params, arrival_time, *, slot), "
      "process_outputs(EngineCoreOutputs) -> ProcessedStep, abort_requests without internal "
      "and no request_states / propagate_error: vLLM code driving it would break"),
    r("002", 8, "engine_core", "llm.core", "attr", None, DIFFER,
      "named core: legato's CoreSteps (add_requests / plan / apply in this thread), not an "
      "EngineCoreClient (add_request, get_output, abort_requests, utility calls); an alias "
      "would break on the first vLLM call"),
    r("002", 9, "logger_manager", "llm.logger_manager", "attr", None, SAME),
    r("002", 10, "model_executor", "llm.model_executor.collective_rpc", "method",
      "(method, timeout=None, args=(), kwargs=None)", SAME,
      "vLLM's in-process executor: driver_worker(.worker).model_runner.model, collective_rpc by "
      "name or callable, check_health (tests/llm/test_drivers.py); on the CPU, new weights go "
      "in through update_weights, not by writing parameters in place (packed linears)"),
    r("002", 11, "from_vllm_config", "LLM.from_vllm_config", "cls", None, SAME),
    r("002", 12, "from_engine_args", "LLM.from_engine_args", "cls",
      "(engine_args, usage_context=None, stat_loggers=None, enable_multiprocessing=False)",
      SAME),
    r("002", 13, "get_num_unfinished_requests", "llm.get_num_unfinished_requests", "method",
      "()", SAME),
    r("002", 14, "has_unfinished_requests", "llm.has_unfinished_requests", "method", "()", SAME),
    r("002", 15, "has_unfinished_requests_dp", "llm.has_unfinished_requests_dp", "method",
      "(has_unfinished)", SAME),
    r("002", 16, "get_supported_tasks", "llm.get_supported_tasks", "method", "()", SAME),
    r("002", 17, "abort_request", "llm.abort_request", "method",
      "(request_ids, internal=False)", SAME),
    r("002", 18, "add_request", "llm.add_request", "method",
      "(request_id, prompt, params, arrival_time=None, lora_request=None,"
      " tokenization_kwargs=None, trace_headers=None, priority=0, prompt_text=None)",
      SAME),
    r("002", 19, "step", "llm.step", "method", "()", SAME),
    r("002", 20, "start_profile", "llm.start_profile", "method", "()", SAME),
    r("002", 21, "stop_profile", "llm.stop_profile", "method", "()", SAME),
    r("002", 22, "reset_mm_cache", "llm.reset_mm_cache", "method", "()", SAME),
    r("002", 23, "reset_prefix_cache", "llm.reset_prefix_cache", "method", RESET_PREFIX, SAME),
    r("002", 24, "reset_encoder_cache", "llm.reset_encoder_cache", "method", "()", SAME),
    r("002", 25, "sleep", "llm.sleep", "method", "(level=1, mode='abort')", SAME),
    r("002", 26, "wake_up", "llm.wake_up", "method", "(tags=None)", SAME),
    r("002", 27, "is_sleeping", "llm.is_sleeping", "method", "()", SAME),
    r("002", 28, "get_metrics", "llm.get_metrics", "method", "()", SAME),
    r("002", 29, "tokenizer", "llm.tokenizer", "attr", None, SAME),
    r("002", 30, "get_tokenizer", "llm.get_tokenizer", "method", "()", SAME),
    r("002", 31, "do_log_stats", "llm.do_log_stats", "method", "()", SAME),
    r("002", 32, "do_log_stats_with_interval", "llm.do_log_stats_with_interval", "method", "()",
      SAME),
    r("002", 33, "add_lora", "llm.add_lora", "method", "(lora_request)", SAME),
    r("002", 34, "remove_lora", "llm.remove_lora", "method", "(lora_id)", SAME),
    r("002", 35, "list_loras", "llm.list_loras", "method", "()", SAME),
    r("002", 36, "pin_lora", "llm.pin_lora", "method", "(lora_id)", SAME),
    r("002", 37, "collective_rpc", "llm.collective_rpc", "method",
      "(method, timeout=None, args=(), kwargs=None)", SAME),
    r("002", 38, "apply_model", "llm.apply_model", "method", "(func)", SAME),
    r("002", 39, "_cleanup_instance_caches", None, "method", None, NA, "torch.compile hooks"),
    r("002", 40, "__del__ (DP group)", None, "method", None, NA, "no DP group"),
    r("002", 41, "validate_outputs", "LLM.validate_outputs", "method", "(outputs, output_type)",
      SAME),
    # ---- 003 early v1 AsyncLLM -> AsyncEngine / open_engine
    r("003", 1, "__init__", "ENG.__init__", "method", "(vllm_config, executor_class, log_stats)",
      DIFFER_SIG, "built by open_engine / from_engine_args inside a nursery"),
    r("003", 2, "log_requests", "eng.log_requests", "attr", None, SAME),
    r("003", 3, "log_stats", "ENG.log_stats", "prop", None, SAME),
    r("003", 4, "stat_loggers", "eng.stat_loggers", "attr", None, SAME),
    r("003", 5, "model_config", "eng.model_config", "attr", None, SAME),
    r("003", 6, "tokenizer", "eng.tokenizer", "attr", None, SAME),
    r("003", 7, "request_streams", "eng.frontend", "attr", None, DIFFER,
      "no id -> AsyncStream map: each request's OutputSlot lives in the Frontend, private; "
      "the stream is the RequestStream generate returns"),
    r("003", 8, "client_aborted_requests", None, "attr", None, NA, "aborts are synchronous"),
    r("003", 9, "processor", "eng.processor", "attr", None, SAME),
    r("003", 10, "detokenizer", "eng.frontend", "attr", None, DIFFER,
      "detokenization is frontend.processor (legato's OutputProcessor, see 002 #7), run by "
      "the 'detokenizer' actor; the early AsyncLLM's Detokenizer client has no counterpart"),
    r("003", 11, "engine_core", "eng.core", "attr", None, DIFFER,
      "named core: legato's trio EngineCore (typed control calls queued to its loop), not "
      "vLLM's EngineCoreClient (add_request_async, get_output_async, utility calls)"),
    r("003", 12, "output_handler", "eng.frontend", "attr", None, DIFFER,
      "no asyncio.Task attribute: the delivery loop is the supervised 'detokenizer' actor "
      "in the engine's nursery, started with the engine (trio: nothing runs unowned)"),
    r("003", 13, "__del__", None, "method", None, DIFFER,
      "lifetime is open_engine's async with (trio: nothing outlives its nursery)"),
    r("003", 14, "from_engine_args", "ENG.from_engine_args", "cls", "(engine_args)", DIFFER,
      "returns an async context manager: async with AsyncEngine.from_engine_args(args)"),
    r("003", 15, "shutdown", "eng.shutdown", "method", "()", SAME),
    r("003", 16, "_get_executor_cls", None, "method", None, NA, "legato's executors"),
    r("003", 17, "add_request", "eng.add_request", "async",
      "(request_id, prompt, params, arrival_time=None, lora_request=None,"
      " tokenization_kwargs=None, trace_headers=None, priority=0)", SAME),
    r("003", 18, "generate", "eng.generate", "agen", GENERATE_V0, SAME),
    r("003", 19, "abort", "eng.abort", "async", "(request_id)", SAME, "the seed's early-v1 stub raises; legato does what the protocol row (001) and vLLM's AsyncLLM today do"),
    r("003", 20, "encode", "eng.encode", "agen", None, SAME, "the seed's early-v1 stub raises; legato does what the protocol row (001) and vLLM's AsyncLLM today do"),
    r("003", 21, "get_model_config", "eng.get_model_config", "async", "()", SAME),
    r("003", 22, "get_decoding_config", "eng.get_decoding_config", "async", "()", SAME,
      "the seed's early-v1 stub raises; legato does what the protocol row (001) and vLLM's AsyncLLM today do"),
    r("003", 23, "get_input_preprocessor", "eng.get_input_preprocessor", "async", "()", SAME),
    r("003", 24, "get_tokenizer", "eng.get_tokenizer", "async", "(lora_request=None)", SAME),
    r("003", 25, "is_tracing_enabled", "eng.is_tracing_enabled", "async", "()", SAME),
    r("003", 26, "do_log_stats", "eng.do_log_stats", "async",
      "(scheduler_outputs=None, model_output=None)", SAME),
    r("003", 27, "check_health", "eng.check_health", "async", "()", SAME),
    r("003", 28, "start_profile", "eng.start_profile", "async", "()", SAME, "the seed's early-v1 stub raises; legato does what the protocol row (001) and vLLM's AsyncLLM today do"),
    r("003", 29, "stop_profile", "eng.stop_profile", "async", "()", SAME, "the seed's early-v1 stub raises; legato does what the protocol row (001) and vLLM's AsyncLLM today do"),
    r("003", 30, "is_running", "ENG.is_running", "prop", None, SAME),
    r("003", 31, "is_stopped", "ENG.is_stopped", "prop", None, SAME),
    r("003", 32, "errored", "ENG.errored", "prop", None, SAME),
    r("003", 33, "dead_error", "ENG.dead_error", "prop", None, SAME),
    r("003", 34, "AsyncLLMEngine alias", "mod:legato:AsyncLLMEngine", "type", None, SAME),
    # ---- 004 vLLM MQLLMEngineClient -> AsyncEngine + executor + heartbeat + supervisor
    r("004", 1, "MQClientClosedError", "mod:legato.protocol.errors:MQClientClosedError", "type",
      None, SAME),
    r("004", 2, "logger", None, "attr", None, NA, "module logger"),
    r("004", 3, "__init__", "ENG.__init__", "method", "(ipc_path, engine_config, engine_pid)",
      DIFFER_SIG, "spawns its own worker; cannot attach to a running one"),
    r("004", 4, "ZMQ sockets / get_data_socket", None, "attr", None, NA, "pipe frames"),
    r("004", 5, "_errored_with", "eng.supervisor", "attr", None, SAME),
    r("004", 6, "vllm_config", "eng.vllm_config", "attr", None, SAME),
    r("004", 7, "model_config", "eng.model_config", "attr", None, SAME),
    r("004", 8, "decoding_config", "eng.decoding_config", "attr", None, SAME),
    r("004", 9, "tokenizer", "eng.tokenizer", "attr", None, SAME),
    r("004", 10, "input_preprocessor", "eng.input_preprocessor", "attr", None, SAME),
    r("004", 11, "output_queues", "eng.frontend", "attr", None, SAME),
    r("004", 12, "output_loop", "eng.frontend", "attr", None, SAME),
    r("004", 13, "health_loop", "mod:legato.actors.heartbeat:run_heartbeat", "attr", None, SAME),
    r("004", 14, "_engine_process", "eng.executor", "attr", None, SAME),
    r("004", 15, "is_unsupported_config", "ENG.is_unsupported_config", "method",
      "(vllm_config)", SAME),
    r("004", 16, "run_heartbeat_loop", "mod:legato.actors.heartbeat:run_heartbeat", "attr", None,
      SAME),
    r("004", 17, "run_output_handler_loop", "eng.frontend", "attr", None, SAME),
    r("004", 18, "_add_output", "mod:legato.actors.output_slot:OutputSlot", "type", None, SAME),
    r("004", 19, "setup", "eng.setup", "async", "()", SAME),
    r("004", 20, "close", "eng.close", "method", "()", SAME),
    r("004", 21, "_set_errored", "eng.supervisor", "attr", None, SAME),
    r("004", 22, "_send_get_data_rpc_request", "eng.executor", "attr", None, DIFFER,
      "no per-call VLLM_RPC_TIMEOUT: a worker that stops answering is found by the heartbeat "
      "(the engine dies: EngineDeadError), not a TimeoutError per call; collective_rpc takes "
      "vLLM's timeout"),
    r("004", 23, "_send_one_way_rpc_request", None, "async", None, NA,
      "private ZMQ plumbing (fire and forget); every control here is request/response"),
    r("004", 24, "_await_ack", None, "async", None, NA,
      "private ZMQ plumbing (polling acks); the heartbeat covers hangs"),
    r("004", 25, "_check_success", "eng.executor", "attr", None, SAME),
    r("004", 26, "_wait_for_server_rpc", "eng.config.engine_ready_timeout", "attr", None, SAME,
      "start-up waits engine_ready_timeout (600 s, vLLM's VLLM_ENGINE_READY_TIMEOUT_S), then "
      "TimeoutError (tests/engine/test_async_engine.py::test_startup_failures_are_clear_and_"
      "reap_the_worker); is_tracing_enabled answers the tracing flag (False)"),
    r("004", 27, "get_input_preprocessor", "eng.get_input_preprocessor", "async", "()", SAME),
    r("004", 28, "get_tokenizer", "eng.get_tokenizer", "async", "(lora_request=None)", SAME),
    r("004", 29, "get_vllm_config", "eng.get_vllm_config", "async", "()", SAME),
    r("004", 30, "get_decoding_config", "eng.get_decoding_config", "async", "()", SAME),
    r("004", 31, "get_model_config", "eng.get_model_config", "async", "()", SAME),
    r("004", 32, "is_tracing_enabled", "eng.is_tracing_enabled", "async", "()", SAME),
    r("004", 33, "abort", "eng.abort", "async", "(request_id)", SAME),
    r("004", 34, "do_log_stats", "eng.do_log_stats", "async",
      "(scheduler_outputs=None, model_output=None)", SAME),
    r("004", 35, "check_health", "eng.check_health", "async", "()", DIFFER,
      "raises EngineDeadError (a RuntimeError, v1 AsyncLLM's type) whose message names the "
      "cause and whose __cause__ is the raw error; this client raised the raw error itself, "
      "so an except clause for the cause's own type would miss it"),
    r("004", 36, "is_running", "ENG.is_running", "prop", None, SAME),
    r("004", 37, "is_stopped", "ENG.is_stopped", "prop", None, SAME),
    r("004", 38, "errored", "ENG.errored", "prop", None, SAME),
    r("004", 39, "dead_error", "ENG.dead_error", "prop", None, SAME),
    r("004", 40, "generate", "eng.generate", "agen", GENERATE_V0, SAME),
    r("004", 41, "encode", "eng.encode", "agen",
      "(prompt, pooling_params, request_id, lora_request=None, trace_headers=None, priority=0)",
      SAME, "serves 'embed'; a task not in get_supported_tasks is a ValueError, as vLLM's"),
    r("004", 42, "_process_request", "eng._submit", "attr", None, SAME),
    r("004", 43, "start_profile", "eng.start_profile", "async", "()", SAME),
    r("004", 44, "stop_profile", "eng.stop_profile", "async", "()", SAME),
    r("004", 45, "reset_mm_cache", "eng.reset_mm_cache", "async", "()", SAME),
    r("004", 46, "reset_prefix_cache", "eng.reset_prefix_cache", "async", "(device=None)",
      DIFFER_SIG, "v1's (reset_running_requests, reset_connector), not v0's device"),
    r("004", 47, "sleep", "eng.sleep", "async", "(level=1)", SAME),
    r("004", 48, "wake_up", "eng.wake_up", "async", "(tags=None)", SAME),
    r("004", 49, "is_sleeping", "eng.is_sleeping", "async", "()", SAME),
    r("004", 50, "add_lora", "eng.add_lora", "async", "(lora_request)", SAME),
    # ---- X cross-cutting types and behaviours
    r("X", 1, "RequestOutput", "mod:legato:RequestOutput", "type",
      "(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, metrics=None,"
      " lora_request=None, encoder_prompt=None, encoder_prompt_token_ids=None,"
      " num_cached_tokens=None, *, multi_modal_placeholders=None, kv_transfer_params=None)",
      SAME),
    r("X", 2, "CompletionOutput", "mod:legato:CompletionOutput", "type",
      "(index, text, token_ids, cumulative_logprob, logprobs, finish_reason=None,"
      " stop_reason=None, lora_request=None)", SAME),
    r("X", 3, "PoolingRequestOutput", "mod:legato:PoolingRequestOutput", "type",
      "(request_id, outputs, prompt_token_ids, num_cached_tokens, finished)", SAME),
    r("X", 4, "RequestOutputKind", "mod:legato:RequestOutputKind", "type", None, SAME),
    r("X", 5, "n>1 parents",
      "test:tests/outputs/test_output_processor.py::test_n3_cumulative_streams_what_advanced_"
      "and_final_only_carries_all", "behaviour", None, SAME),
    r("X", 6, "prompt forms",
      "test:tests/engine/test_vllm_compat.py::test_a_streaming_input_session_as_vllms",
      "behaviour", None, SAME, "embeds prompts refused (ValueError) as vLLM refuses them without enable_prompt_embeds, which EngineArgs refuses by name; encoder/decoder prompts refused (decoder-only models)"),
    r("X", 7, "stat-logger API",
      "test:tests/metrics/test_stats.py::test_a_logger_written_for_vllm_is_built_and_fed_in_"
      "vllms_shape", "behaviour", None, SAME),
    r("X", 8, "cancellation -> abort",
      "test:tests/engine/test_async_engine.py::test_cancelled_scopes_abort_their_requests_and_free_blocks",
      "behaviour", None, SAME),
    r("X", 9, "dead-engine broadcast",
      "test:tests/engine/test_async_engine.py::test_engine_death_fails_every_stream", "behaviour", None, SAME),
    r("X", 10, "error types",
      "test:tests/protocol/test_errors.py::test_engine_dead_error_is_a_runtime_error_built_"
      "without_arguments", "behaviour", None, SAME),
    r("X", 11, "priority under fcfs",
      "test:tests/engine/test_vllm_compat.py::test_generate_checks_vllms_extra_arguments",
      "behaviour", None, SAME),
    r("X", 12, "duplicate live request_id",
      "test:tests/engine/test_async_engine.py::test_duplicate_live_request_id_is_refused", "behaviour", None,
      SAME),
    r("X", 13, "structured outputs / logits processors", None, "behaviour", None, DIFFER,
      "per-request logits_processors are refused (nothing is pickled)"),
]

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the checks


def parse(signature: str) -> inspect.Signature:
    """vLLM's signature as written in a row (names and defaults only)."""
    namespace: dict[str, Any] = {}
    exec(f"def f{signature}: pass", namespace)  # noqa: S102 - the rows' own literals
    return inspect.signature(namespace["f"])


def incompatibility(vllm: inspect.Signature, ours: inspect.Signature) -> str | None:
    """Why a call valid against ``vllm`` may fail against ``ours``; None if none can."""
    kinds = inspect.Parameter
    mine = [p for p in ours.parameters.values() if p.name not in ("self", "cls")]
    positional = [p for p in mine if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in mine if p.kind is not kinds.POSITIONAL_ONLY}
    var_pos = any(p.kind is kinds.VAR_POSITIONAL for p in mine)
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in mine)
    theirs = list(vllm.parameters.values())
    for i, p in enumerate(theirs):
        if p.kind is kinds.POSITIONAL_OR_KEYWORD:
            if i < len(positional):
                if positional[i].name != p.name:
                    return f"positional #{i} is {positional[i].name!r}, vLLM's is {p.name!r}"
                q = positional[i]
            elif var_pos and (p.name in by_name or var_kw):
                continue
            else:
                return f"{p.name!r} is not accepted positionally (#{i})"
        else:  # keyword-only in vLLM
            found = by_name.get(p.name)
            if found is None:
                if var_kw:
                    continue
                return f"no parameter {p.name!r}"
            q = found
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            return f"{p.name!r} is required here, optional in vLLM"
    names = {p.name for p in theirs}
    for q in mine:
        if q.name not in names and q.default is inspect.Parameter.empty and q.kind in (
            kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY, kinds.POSITIONAL_ONLY
        ):
            return f"{q.name!r} is required here and unknown to vLLM"
    return None


MISSING_VALUE = object()


def resolve(target: str, owners: dict[str, Any]) -> Any:
    """The legato object a target names; MISSING_VALUE if it does not exist."""
    if target.startswith("mod:"):
        _, module, name = target.split(":")
        return getattr(importlib.import_module(module), name, MISSING_VALUE)
    owner, name = target.split(".", 1)
    obj = owners[owner]
    if owner.isupper():
        try:
            return inspect.getattr_static(obj, name)
        except AttributeError:
            return MISSING_VALUE
    for part in name.split("."):  # "renderer.render_cmpl": a member of a member
        obj = getattr(obj, part, MISSING_VALUE)
        if obj is MISSING_VALUE:
            break
    return obj


def kind_problem(row: Row, found: Any) -> str | None:
    function = found.__func__ if isinstance(found, classmethod) else found
    checks = {
        "attr": lambda: True,
        "type": lambda: isinstance(found, type) or callable(found),
        "prop": lambda: isinstance(found, property),
        "cls": lambda: isinstance(found, classmethod),
        "method": lambda: callable(found) and not inspect.iscoroutinefunction(function),
        "async": lambda: inspect.iscoroutinefunction(function),
        "agen": lambda: callable(found),
    }
    return None if checks[row.kind]() else f"is not a {row.kind}: {found!r}"


def check(row: Row, owners: dict[str, Any]) -> str | None:
    """What is wrong with ``row``'s verdict; None if the code bears it out."""
    if row.verdict == NA or row.target is None:
        return None
    if row.target.startswith("test:"):
        path, _, name = row.target[5:].partition("::")
        text = (ROOT / path).read_text()
        return None if f"def {name}" in text else f"{path} has no test {name}"
    found = resolve(row.target, owners)
    if row.verdict == MISSING:
        return None if found is MISSING_VALUE else f"{row.target} exists now: update the row"
    if found is MISSING_VALUE:
        return f"{row.target} does not exist"
    if row.verdict == NIE:
        default = inspect.getattr_static(EngineClient, row.member, None)
        mine = inspect.getattr_static(type(owners["eng"]), row.member, None)
        return None if mine is default else f"{row.target} overrides the protocol's default"
    problem = kind_problem(row, found)
    if problem is not None:
        return problem
    if row.vllm is None:
        return None
    function = found.__func__ if isinstance(found, classmethod) else found
    why = incompatibility(parse(row.vllm), inspect.signature(function))
    if row.verdict == DIFFER_SIG:
        return None if why else "its signature is compatible now: update the row"
    return None if why is None else f"signature: {why}"


def tally(rows: list[Row]) -> Counter[str]:
    return Counter("differ" if row.verdict == DIFFER_SIG else row.verdict for row in rows)


# ------------------------------------------------------------------ the tests


def test_the_rows_are_the_reviews_205() -> None:
    groups = Counter(row.group for row in ROWS)
    assert groups == {"000": 31, "001": 36, "002": 41, "003": 34, "004": 50, "X": 13}
    assert len({(row.group, row.number) for row in ROWS}) == len(ROWS) == 205
    for row in ROWS:
        assert row.verdict == SAME or row.why or row.verdict == NIE, row
        if row.vllm is not None:
            parse(row.vllm)


def test_the_signature_check_catches_what_breaks_a_vllm_call() -> None:
    def keyword_only(request_id: str, *, lora_request: Any = None) -> None: ...

    def renamed(rid: str, lora_request: Any = None) -> None: ...

    def extra_required(request_id: str, lora_request: Any, flag: bool) -> None: ...

    def fine(request_id: str, lora_request: Any = None, extra: int = 0) -> None: ...

    vllm = parse("(request_id, lora_request=None)")
    assert incompatibility(vllm, inspect.signature(keyword_only))
    assert incompatibility(vllm, inspect.signature(renamed))
    assert incompatibility(vllm, inspect.signature(extra_required))
    assert incompatibility(vllm, inspect.signature(fine)) is None


@pytest.fixture
async def owners(toy_model_dir: Any) -> AsyncIterator[dict[str, Any]]:
    args = dict(max_model_len=128, num_kv_blocks=32, disable_log_stats=True)
    llm = LLMEngine.from_engine_args(str(toy_model_dir), executor="inproc", **args)
    async with open_engine(str(toy_model_dir), executor="inproc", **args) as engine:
        yield {
            "ro": RenderOnlyClient(str(toy_model_dir)),
            "RO": RenderOnlyClient,
            "eng": engine,
            "ENG": AsyncEngine,
            "abc": EngineClient,
            "llm": llm,
            "LLM": LLMEngine,
        }


async def test_every_row_matches_the_code(owners: dict[str, Any]) -> None:
    wrong = [
        f"{row.group} #{row.number} {row.member} ({row.verdict}): {problem}"
        for row in ROWS
        if (problem := check(row, owners)) is not None
    ]
    assert not wrong, "\n".join(wrong)
    assert legato.__version__  # the package the rows describe


def summary() -> Iterator[str]:
    counts = tally(ROWS)
    yield f"{len(ROWS)} rows: " + ", ".join(
        f"{counts[v]} {v}" for v in ("same", "n/a", "differ", "missing", "nie")
    )
    for group in ("000", "001", "002", "003", "004", "X"):
        in_group = tally([row for row in ROWS if row.group == group])
        yield f"  {group}: " + ", ".join(f"{in_group[v]} {v}" for v in sorted(in_group))


if __name__ == "__main__":
    print("\n".join(summary()))
