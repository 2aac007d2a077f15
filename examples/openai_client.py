"""The official ``openai`` client against ``legato serve``: a streamed chat, then a plain completion.

    legato serve &                      # SmolLM2-135M-Instruct, served under that name
    python examples/openai_client.py    # or: --base-url http://HOST:PORT/v1 --api-key KEY

Nothing legato-specific here: point any OpenAI client at the server's /v1.
vLLM's extra sampling fields (top_k, min_p, ignore_eos, ...) go in ``extra_body``.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main(base_url: str, api_key: str) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    stream = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": "Tell me a short story."},
        ],
        max_tokens=32,
        temperature=0.8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 50},
    )
    with stream:
        for chunk in stream:
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
                if choice.finish_reason:
                    print(f"\n[finish_reason={choice.finish_reason}]")
            if chunk.usage:
                print(
                    f"[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion]"
                )

    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, temperature=0
    )
    print(f"completion: {completion.choices[0].text!r} ({completion.choices[0].finish_reason})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    args = parser.parse_args()
    main(args.base_url, args.api_key)
