"""A request's own chat template, rendered in a child process with limits.

A caller's Jinja template is code: nested loops never end and ``'x' * 10**10``
exhausts memory, and jinja2's sandbox stops neither. So the server refuses a
per-request ``chat_template`` unless the operator passes
``--trust-request-chat-template`` (vLLM's flag), and even then renders it here:
in a fresh interpreter (``python -I``, jinja2's ``ImmutableSandboxedEnvironment``
only) with a CPU-time limit, an address-space limit, a wall-clock deadline and a
cap on the text it returns. A template that breaks a limit fails its request
with a 400 naming ``chat_template``; nothing runs on the event loop or holds the
server's GIL. The environment follows transformers' (``trim_blocks``,
``lstrip_blocks``, loop controls, ``tojson``, ``raise_exception``,
``strftime_now``); the ``{% generation %}`` tag is not supported.

Never imports torch; the child imports jinja2 and the standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from ..protocol.errors import ValidationError

CPU_SECONDS = 2
"""CPU time a template may use (RLIMIT_CPU)."""
WALL_SECONDS = 5.0
"""Wall-clock time for the whole render, interpreter start included."""
MEMORY_BYTES = 1 << 30
"""Address space of the child (RLIMIT_AS)."""
MAX_OUTPUT_CHARS = 1 << 20
"""The longest prompt a template may write."""

_CHILD = r"""
import json, resource, sys
cpu, memory, max_chars = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
from datetime import datetime
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

job = json.loads(sys.stdin.read())
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                    extensions=["jinja2.ext.loopcontrols"])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
try:
    text = env.from_string(job["template"]).render(**job["variables"])
except MemoryError:
    print("it needs more memory than allowed", file=sys.stderr); sys.exit(3)
except Exception as exc:
    print(f"{type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr); sys.exit(2)
if len(text) > max_chars:
    print(f"it wrote more than {max_chars} characters", file=sys.stderr); sys.exit(3)
sys.stdout.write(text)
"""


async def render_request_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    special_tokens: Mapping[str, str],
    template_kwargs: Mapping[str, Any],
) -> str:
    """The text ``template`` renders for the chat, in a limited child process.

    A checkpoint. Raises ValidationError (field ``chat_template``) if the
    template fails, runs out of time or memory, or writes too much; the child
    is killed on a deadline or on cancellation (``trio.run_process``).
    """
    variables: dict[str, Any] = {
        **special_tokens,
        **template_kwargs,
        "messages": [dict(m) for m in messages],
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
    }
    job = json.dumps({"template": template, "variables": variables}).encode()
    command = [
        sys.executable,
        "-I",
        "-c",
        _CHILD,
        str(CPU_SECONDS),
        str(MEMORY_BYTES),
        str(MAX_OUTPUT_CHARS),
    ]
    result: subprocess.CompletedProcess[bytes] | None = None
    with trio.move_on_after(WALL_SECONDS):
        result = await trio.run_process(
            command, stdin=job, capture_stdout=True, capture_stderr=True, check=False
        )
    if result is None:
        raise ValidationError("chat_template", f"the template ran out of time ({WALL_SECONDS} s)")
    if result.returncode != 0:
        why = result.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = why[-1] if why and result.returncode in (2, 3) else "it ran out of CPU time"
        raise ValidationError("chat_template", f"the template failed: {reason[:300]}")
    return result.stdout.decode("utf-8", "replace")
