"""A client of ``legato serve``'s WebSocket endpoint: concurrent requests, JSON and msgpack, abort.

    legato serve &                        # HTTP on :8000, WebSocket on :8001
    python examples/websocket_client.py   # or: --url ws://HOST:PORT/ --api-key KEY

One connection carries several requests at once; frames for different
requests interleave. The protocol is documented in ``docs/websocket.md``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgpack
import trio
from trio_websocket import WebSocketConnection, open_websocket_url


async def send(ws: WebSocketConnection, frame: dict[str, Any], binary: bool) -> None:
    """Text frames carry JSON; binary frames carry msgpack. Replies come in the same encoding."""
    await ws.send_message(msgpack.packb(frame) if binary else json.dumps(frame))


def decode(message: str | bytes) -> dict[str, Any]:
    if isinstance(message, bytes):
        frame: dict[str, Any] = msgpack.unpackb(message)
    else:
        frame = json.loads(message)
    return frame


async def main(url: str, api_key: str | None) -> None:
    headers = [(b"Authorization", f"Bearer {api_key}".encode())] if api_key else None
    async with open_websocket_url(url, extra_headers=headers) as ws:
        params = {"max_tokens": 24, "temperature": 0.0}
        await send(
            ws,
            {"type": "generate", "request_id": "json", "prompt": "Hello", "params": params},
            False,
        )
        chat = [{"role": "user", "content": "Tell me a story"}]
        await send(
            ws, {"type": "generate", "request_id": "chat", "messages": chat, "params": params}, True
        )
        long = {"max_tokens": 400, "ignore_eos": True}
        await send(
            ws, {"type": "generate", "request_id": "long", "prompt": "Once", "params": long}, False
        )

        texts: dict[str, str] = {}
        pending = {"json", "chat", "long"}
        while pending:
            frame = decode(await ws.get_message())
            rid = frame.get("request_id", "?")
            if frame["type"] == "error":
                print(f"[{rid}] error {frame['code']}: {frame['message']}")
                pending.discard(rid)
                continue
            texts[rid] = texts.get(rid, "") + frame["text"]
            if rid == "long" and len(texts[rid]) > 20 and "abort sent" not in texts:
                await send(ws, {"type": "abort", "request_id": "long"}, False)
                texts["abort sent"] = ""
            if frame["finished"]:
                usage = frame["usage"]
                print(
                    f"[{rid}] {frame['finish_reason']}: {texts[rid]!r} "
                    f"({usage['prompt_tokens']} prompt + {usage['completion_tokens']} generated tokens)"
                )
                pending.discard(rid)
        await ws.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="ws://127.0.0.1:8001/")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    trio.run(main, args.url, args.api_key)
