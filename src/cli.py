"""The ``legato`` command: demo | generate | toy-model | serve | worker | bench serve.

Engine arguments use vLLM's flag names (``--max-model-len``, ``--dtype``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


MODEL_HELP = (
    "a local HF model directory or .gguf file; 'toy' for the toy model"
    " (default: the embedded SmolLM2-135M-Instruct)"
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (except ``model``, a positional, and
    ``served_model_name``, which ``serve`` takes with its server flags)."""
    from .config import EngineConfig

    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        if field.name in ("model", "served_model_name"):
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, int | float) and not isinstance(default, bool):
            group.add_argument(flag, type=type(default), default=default)
        elif field.name in (
            "max_model_len",
            "num_kv_blocks",
            "kv_cache_memory",
            "max_cpu_loras",
            "max_num_batched_tokens",
        ):
            group.add_argument(flag, type=int, default=None)
        elif field.name == "speculative_config":
            group.add_argument(
                flag,
                type=_json_object,
                default=None,
                help='JSON, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": 3} '
                'or {"model": DRAFT_MODEL_DIR, "num_speculative_tokens": 3}',
            )
        else:
            group.add_argument(flag, default=default)


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (argparse reports the error with the flag's name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from .config import EngineConfig

    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name != "model" and hasattr(args, f.name)
    }


def cmd_toy_model(args: argparse.Namespace) -> int:
    from .toy_model import build_toy_model, describe

    path = build_toy_model(args.dir, seed=args.seed)
    print(describe(path))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Set up (once) and describe the model, round-trip text, generate."""
    import trio

    from .model_source import resolve_model_source
    from .tokenizer_loading import load_tokenizer
    from .toy_model import describe

    started = time.monotonic()
    path = resolve_model_source(args.model).path
    if os.path.isdir(path):
        print(describe(path))
    tokenizer = load_tokenizer(str(path))
    text = "héllo 世界 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    back = tokenizer.decode(ids)
    print(
        f"tokenizer round trip: {text!r} -> {ids} -> {back!r} ({'ok' if back == text else 'MISMATCH'})"
    )
    kwargs = engine_kwargs(args)
    trio.run(_stream_generate, path, args.prompt, args.max_tokens, 0.0, kwargs)
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0 if back == text else 1


async def _stream_generate(
    model: str | None, prompt: str, max_tokens: int, temperature: float, kwargs: dict[str, Any]
) -> None:
    from .engine import open_engine
    from .protocol.params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, output_kind=RequestOutputKind.DELTA
    )
    async with open_engine(model, **kwargs) as engine:
        print(f"prompt: {prompt!r}\ncompletion: ", end="", flush=True)
        async with engine.generate(prompt, params, "cli") as stream:
            async for out in stream:
                print(out.outputs[0].text, end="", flush=True)
                reason = out.outputs[0].finish_reason
        print(f"\n[finish_reason={reason}]")


def cmd_generate(args: argparse.Namespace) -> int:
    import trio

    trio.run(
        _stream_generate,
        args.model,
        args.prompt,
        args.max_tokens,
        args.temperature,
        engine_kwargs(args),
    )
    return 0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The ``legato serve`` flags for the HTTP and WebSocket front ends."""
    from .server.state import ServerSettings

    d = ServerSettings()
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=d.port, help="HTTP port; 0 = a free port")
    group.add_argument(
        "--ws-port", type=int, default=d.ws_port, help="WebSocket port; 0 = a free port"
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("LEGATO_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (env LEGATO_API_KEY)",
    )
    group.add_argument("--served-model-name", default=None, help="the model name clients ask for")
    group.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="HTTP body limit (413)"
    )
    group.add_argument("--max-n", type=int, default=d.max_n, help="largest n a request may ask for")
    group.add_argument(
        "--ws-max-frame-bytes", type=int, default=d.ws_max_frame_bytes, help="WebSocket frame limit"
    )
    group.add_argument(
        "--ws-max-requests",
        type=int,
        default=d.ws_max_requests,
        help="concurrent requests per WebSocket connection",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="seconds a client may take to send a request body (408 after)",
    )
    group.add_argument(
        "--send-timeout",
        type=float,
        default=d.send_timeout,
        help="seconds an HTTP client may take to read each 128 KiB of an answer "
        "(then the connection closes and its request is aborted)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="connections served at once per port (503 past it)",
    )
    group.add_argument(
        "--max-requests-in-flight",
        type=int,
        default=d.max_requests_in_flight,
        help="HTTP and WebSocket requests in flight at once (503 server_busy past it)",
    )
    group.add_argument(
        "--max-sequences-in-flight",
        type=int,
        default=d.max_sequences_in_flight,
        help="engine sequences in flight at once, each of a request's n counted: bounds the "
        "engine's waiting queue (503 server_busy past it)",
    )
    group.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=d.responses_store_max_entries,
        help="Responses API responses kept in memory for GET and previous_response_id "
        "(the oldest is evicted past it)",
    )
    group.add_argument(
        "--responses-store-max-age",
        type=float,
        default=d.responses_store_max_age,
        help="seconds a stored Responses API response is kept",
    )
    group.add_argument(
        "--responses-store-max-chars",
        type=int,
        default=d.responses_store_max_chars,
        help="characters of text all stored Responses API responses may hold (the oldest "
        "are evicted past it)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace,
        help="seconds requests in flight may take to finish after SIGINT/SIGTERM",
    )
    group.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per finished request"
    )
    group.add_argument(
        "--no-web-ui",
        dest="web_ui",
        action="store_false",
        help="do not serve the chat page at / on the HTTP port",
    )
    group.add_argument(
        "--web-ui-ws-url",
        default=None,
        help="the WebSocket URL the chat page connects to, when the browser reaches the "
        "WebSocket port at another host or port (default: the page's host, --ws-port)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as model names; needs --enable-lora. "
        'Also vLLM\'s JSON form {"name": ..., "path": ..., "base_model_name": ...}',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    group.add_argument(
        "--lora-root",
        default=None,
        help="with --allow-runtime-lora-updating: the directory run-time adapters must lie "
        "under (required with it)",
    )
    group.add_argument(
        "--restart-on-failure",
        action="store_true",
        help="restart a dead engine in place (the servers keep running; /health is 503 meanwhile)",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="with --restart-on-failure: exit with status 1 after more restarts than this "
        "within --restart-window (default: %(default)s)",
    )
    group.add_argument(
        "--restart-window",
        type=float,
        default=300.0,
        help="seconds over which --max-restarts counts (default: %(default)s)",
    )
    add_openai_features_args(parser)


def add_openai_features_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for chat templates, tool calling, reasoning and CORS."""
    group = parser.add_argument_group("chat, tools and CORS (as vLLM's flags)")
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file used instead of the model's",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own chat_template (rendered in a child process with CPU, "
        "memory and time limits); refused by default",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice="auto" (needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser", default=None, help="how auto tool calls are read: hermes, llama3_json"
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think> reasoning into reasoning_content: qwen3, deepseek_r1",
    )
    group.add_argument(
        "--allowed-origins",
        default="[]",
        help="CORS, and WebSocket Origins besides the chat page's own: a JSON list; none by "
        "default, '[\"*\"]' allows any (a warning without --api-key)",
    )
    group.add_argument(
        "--allowed-hosts",
        default="[]",
        help="Host header values served besides localhost, 127.0.0.1, ::1 and --host "
        "(DNS rebinding guard): a JSON list; '[\"*\"]' turns the check off",
    )
    group.add_argument("--allowed-methods", default='["*"]', help="CORS: a JSON list of methods")
    group.add_argument("--allowed-headers", default='["*"]', help="CORS: a JSON list of headers")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def openai_features_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings fields from :func:`add_openai_features_args`' flags; ValueError naming
    the flag when one is wrong."""
    from .server.cors import CORSPolicy, parse_list_flag

    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--chat-template: cannot read {args.chat_template}: {exc}") from None
    cors = CORSPolicy(
        parse_list_flag("--allowed-origins", args.allowed_origins),
        parse_list_flag("--allowed-methods", args.allowed_methods),
        parse_list_flag("--allowed-headers", args.allowed_headers),
        args.allow_credentials,
    )
    return dict(
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        cors=cors,
        allowed_hosts=parse_list_flag("--allowed-hosts", args.allowed_hosts),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the engine with the OpenAI-compatible HTTP API and the WebSocket endpoint."""
    import trio

    from .server.app import serve
    from .server.lora_routes import parse_lora_modules
    from .server.state import ServerSettings
    from .supervise import RestartLimitExceeded, RestartPolicy

    try:
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            ws_port=args.ws_port,
            api_key=args.api_key or None,
            served_model_name=args.served_model_name,
            max_body_bytes=args.max_body_bytes,
            max_n=args.max_n,
            ws_max_frame_bytes=args.ws_max_frame_bytes,
            ws_max_requests=args.ws_max_requests,
            shutdown_grace=args.shutdown_grace,
            body_timeout=args.body_timeout,
            send_timeout=args.send_timeout,
            max_connections=args.max_connections,
            max_requests_in_flight=args.max_requests_in_flight,
            max_sequences_in_flight=args.max_sequences_in_flight,
            responses_store_max_entries=args.responses_store_max_entries,
            responses_store_max_age=args.responses_store_max_age,
            responses_store_max_chars=args.responses_store_max_chars,
            log_requests=not args.disable_log_requests,
            web_ui=args.web_ui,
            web_ui_ws_url=args.web_ui_ws_url,
            lora_modules=parse_lora_modules(args.lora_modules),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            lora_root=args.lora_root,
            **openai_features_settings(args),
        )
        if settings.lora_modules and not args.enable_lora:
            raise ValueError("lora_modules: serving LoRA adapters needs --enable-lora")
        restart = None
        if args.restart_on_failure:
            restart = RestartPolicy(args.max_restarts, args.restart_window)
    except ValueError as exc:
        print(f"legato serve: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(
            functools.partial(serve, restart=restart), args.model, engine_kwargs(args), settings
        )
    except RestartLimitExceeded as exc:
        print(f"legato serve: {exc}", file=sys.stderr)
        return 1
    except (OSError, BaseExceptionGroup) as exc:  # e.g. a port is taken (maybe grouped)
        found = _leaf(exc, OSError)
        if found is None:
            raise
        print(f"legato serve: {found}", file=sys.stderr)
        return 1
    return 0


def _leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``exc`` or, depth first, in its exception groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _leaf(inner, kind)
            if found is not None:
                return found
    return None


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Benchmark a running server over HTTP and print the result table."""
    import trio

    try:
        from .server.bench import run_bench
    except ImportError as exc:
        print(f"legato: {exc}", file=sys.stderr)
        return 2

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    report = trio.run(
        functools.partial(
            run_bench,
            args.url,
            model=args.model,
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            api_key=args.api_key,
        )
    )
    print(report.table())
    return 0 if report.ok else 1


def cmd_worker(args: argparse.Namespace) -> int:
    """Run this node's tensor-parallel ranks for an engine on another node."""
    from .workers.node import run_node

    try:
        return run_node(
            args.tensor_parallel_size, args.nnodes, args.node_rank, args.master_addr,
            args.master_port,
        )  # fmt: skip
    except ValueError as exc:
        print(f"legato worker: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="legato", description="trio-native LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    toy = sub.add_parser("toy-model", help="build the deterministic toy checkpoint into DIR")
    toy.add_argument("dir")
    toy.add_argument("--seed", type=int, default=0)
    toy.set_defaults(func=cmd_toy_model)

    demo = sub.add_parser("demo", help="describe the model, round-trip text, generate a little")
    demo.add_argument("--model", default=None, help=MODEL_HELP)
    demo.add_argument("--prompt", default="Once upon a time")
    demo.add_argument("--max-tokens", type=int, default=16)
    add_engine_args(demo)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API and the WebSocket endpoint"
    )
    serve.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser(
        "worker",
        help="run this node's tensor-parallel ranks for `legato serve --nnodes N` on node 0",
    )
    worker.add_argument("--tensor-parallel-size", type=int, required=True)
    worker.add_argument("--nnodes", type=int, required=True)
    worker.add_argument("--node-rank", type=int, required=True, help="this node: 1..nnodes-1")
    worker.add_argument("--master-addr", required=True, help="node 0's address (rank 0)")
    worker.add_argument("--master-port", type=int, required=True)
    worker.set_defaults(func=cmd_worker)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve", help="drive a running server over HTTP; print a table"
    )
    bench_serve.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    bench_serve.add_argument(
        "--model", default=None, help="model name (default: the server's first)"
    )
    bench_serve.add_argument("--num-prompts", type=int, default=100)
    bench_serve.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson; inf = all at once",
    )
    bench_serve.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    bench_serve.add_argument(
        "--output-len", type=int, default=32, help="generated tokens per request"
    )
    bench_serve.add_argument("--seed", type=int, default=0)
    bench_serve.add_argument("--api-key", default=os.environ.get("LEGATO_API_KEY"))
    bench_serve.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    from .protocol.errors import EngineStartupError

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        code = args.func(args)
    except (EngineStartupError, BaseExceptionGroup) as exc:  # a bad model: one line, no traceback
        found = _leaf(exc, EngineStartupError)
        if found is None:
            raise
        print(f"legato {args.command}: {found}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
