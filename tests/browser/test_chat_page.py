"""The chat page in headless Chromium against ``legato serve`` on the real default model
(SmolLM2-135M-Instruct; a subprocess with a worker process).

A user's session, by keyboard where a keyboard user would: chat with streamed
answers, two answers streaming at once on one connection, Stop (a button and
Escape) aborting the request on the server, a killed worker reported as a dead
engine, and a restarted engine picked up without a reload, with an API key and
the WebSocket at another host than the page. What the server did is checked
from the server (its request log lines, /health), not only from the page.

Heavy (a browser and three servers): deselected by default; run it with
``scripts/test-browser.sh``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from legato.default_model import DEFAULT_MODEL_NAME

from .conftest import ChatPage, ServeProcess, console_errors

pytestmark = pytest.mark.browser

LONG_PROMPT = "Count from 1 to 500, one number per line."
STORY_PROMPT = "Write a long story about a lighthouse keeper."
LONG_MAX_TOKENS = 600
HEALTH_503 = r"/health - Failed to load resource: the server responded with a status of 503"


def request_log(server: ServeProcess, request_id: str) -> tuple[int, str]:
    """The server's log line for a finished WebSocket request: completion tokens, outcome."""
    match = server.wait_for(
        rf"request ws\d+-{re.escape(request_id)}: prompt_tokens=\d+ "
        r"completion_tokens=(\d+) latency=\S+ outcome=(.+)$"
    )
    return int(match.group(1)), match.group(2)


def tokens_shown(reply: dict[str, object]) -> int:
    match = re.match(r"(\d+) tokens?", str(reply["meta"]))
    assert match is not None, reply
    return int(match.group(1))


def streaming(frames: int) -> Callable[[dict[str, object]], bool]:
    """A reply still streaming that has had at least ``frames`` output frames."""
    return lambda r: r["state"] == "streaming" and int(str(r["frames"])) >= frames


def test_chat_streams_answers_and_stop_aborts_on_the_server(
    serve: Callable[..., ServeProcess], page: ChatPage, tmp_path: Path
) -> None:
    from selenium.webdriver.common.keys import Keys

    server = serve()
    page.open(server.http_url + "/")
    page.wait_ready()
    config = server.get("/ui/config.json").json()
    assert config["model"] == DEFAULT_MODEL_NAME
    assert page.element("model-name").text == DEFAULT_MODEL_NAME
    assert page.element("ws-url").get_attribute("value") == f"{server.ws_url}/"

    # by keyboard: every control is a Tab stop, the first one the skip link to the message box
    order = page.tab_order(10)
    assert order == [
        "skip-link", "prompt", "send", "new-chat", "system", "temperature", "max-tokens",
        "api-key", "ws-url", "connect",
    ], order  # fmt: skip
    page.driver.refresh()
    page.wait_ready()
    page.press(Keys.TAB)
    assert page.focused_id() == "skip-link"
    page.press(Keys.ENTER)
    assert page.focused_id() == "prompt"
    page.fill("temperature", "0")
    page.fill("max-tokens", "64")
    page.send_message("What is the capital of France?")
    answer = page.wait_reply(0, lambda r: r["state"] == "done")
    assert "Paris" in answer["text"], answer  # the real model, greedy, through its chat template
    assert answer["frames"] > 1, answer  # streamed, not one block
    assert answer["finish_reason"] in ("stop", "length"), answer
    assert answer["ttft_ms"] is not None and answer["tokens_per_s"] is not None, answer
    for shown in ("TTFT", "ms", "tok/s", f"finish_reason: {answer['finish_reason']}"):
        assert shown in answer["meta"], answer
    completion_tokens, outcome = request_log(server, "chat-1")
    assert outcome == answer["finish_reason"]
    assert completion_tokens == tokens_shown(answer)

    # two answers at once on one connection; Stop aborts one of them in the engine
    page.fill("max-tokens", str(LONG_MAX_TOKENS))
    page.send_message(STORY_PROMPT)
    page.wait_reply(1, streaming(8))
    page.fill("max-tokens", "24")
    page.send_message("Say hello in French.")
    page.wait_reply(2, streaming(1))
    assert page.reply(1)["state"] == "streaming"  # both live
    stop = page.driver.find_element("css selector", '[data-request-id="chat-2"] .stop-one')
    stop.click()
    stopped = page.wait_reply(1, lambda r: r["state"] == "stopped", 30)
    assert stopped["finish_reason"] == "abort"
    assert "finish_reason: abort" in stopped["meta"]
    completion_tokens, outcome = request_log(server, "chat-2")  # the engine ended it: abort
    assert outcome == "abort" and completion_tokens < LONG_MAX_TOKENS
    other = page.wait_reply(2, lambda r: r["state"] == "done")
    assert other["finish_reason"] in ("stop", "length") and other["text"].strip()
    assert request_log(server, "chat-3")[1] == other["finish_reason"]
    assert page.contrast_problems() == []
    shot = tmp_path / "chat.png"
    assert page.driver.save_screenshot(str(shot))
    if target := os.environ.get("LEGATO_WEB_UI_SCREENSHOT"):  # for docs/web-ui.png
        shutil.copyfile(shot, target)

    # Escape stops every answer
    page.fill("max-tokens", str(LONG_MAX_TOKENS))
    page.send_message("Now count from 500 down to 1.")
    page.wait_reply(3, streaming(2))
    page.press(Keys.ESCAPE)
    assert page.wait_reply(3, lambda r: r["state"] == "stopped", 30)["finish_reason"] == "abort"
    completion_tokens, outcome = request_log(server, "chat-4")
    assert outcome == "abort" and completion_tokens < LONG_MAX_TOKENS

    assert page.status()["banner"] is None
    assert console_errors(page.driver) == []
    page.color_scheme("dark")
    assert page.contrast_problems() == []
    if target:
        page.driver.save_screenshot(target.replace(".png", "-dark.png"))


def test_a_killed_worker_shows_the_dead_engine(
    serve: Callable[..., ServeProcess], page: ChatPage
) -> None:
    server = serve()
    page.open(server.http_url + "/")
    page.wait_ready()
    page.fill("max-tokens", str(LONG_MAX_TOKENS))
    page.send_message(LONG_PROMPT)
    page.wait_reply(0, streaming(2))
    server.kill_worker()

    lost = page.wait_reply(0, lambda r: r["state"] == "error", 30)
    assert lost["error_code"] == "engine_dead" and lost["text"], lost
    page.wait(lambda: page.status()["engine"] == "dead", 30, "engine dead")
    status = page.status()
    assert status["banner_kind"] == "dead" and "The engine is dead." in status["banner"], status
    assert "Engine dead" in status["text"]
    assert page.contrast_problems() == []
    if target := os.environ.get("LEGATO_WEB_UI_SCREENSHOT"):
        page.driver.save_screenshot(target.replace(".png", "-dead.png"))
    health = server.get("/health")
    assert (health.status_code, health.json()["error"]["code"]) == (503, "engine_dead")
    assert request_log(server, "chat-1")[1] == "error: engine_dead"

    page.send_message("Hello?")  # a new request gets the same answer
    again = page.wait_reply(1, lambda r: r["state"] == "error", 30)
    assert again["error_code"] == "engine_dead"
    assert console_errors(page.driver, allowed=(HEALTH_503,)) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_a_restarted_engine_is_back_without_a_reload(
    serve: Callable[..., ServeProcess], page: ChatPage
) -> None:
    from selenium.webdriver.common.keys import Keys

    # the page from http://localhost, the WebSocket at 127.0.0.1: another host, told by a flag
    ws_port = free_port()
    ws_url = f"ws://127.0.0.1:{ws_port}/"
    server = serve(
        "--restart-on-failure", "--api-key", "secret", "--ws-port", str(ws_port),
        "--web-ui-ws-url", ws_url,
    )  # fmt: skip
    page.open(f"http://localhost:{server.port}/")
    assert page.element("ws-url").get_attribute("value") == ws_url
    page.wait(lambda: page.status()["connection"] == "need_key", 30, "asks for the key")
    assert "needs an API key" in page.status()["banner"]
    assert page.element("key-required").is_displayed()

    page.fill("api-key", "wrong")
    page.element("api-key").send_keys(Keys.ENTER)  # submits the Connection form
    page.wait(lambda: page.status()["connection"] == "auth_failed", 30, "key refused")
    assert "The API key was refused." in page.status()["banner"]
    page.fill("api-key", "secret")
    page.element("api-key").send_keys(Keys.ENTER)
    page.wait_ready()

    page.driver.execute_script("window.samePage = 'yes'")
    page.fill("max-tokens", str(LONG_MAX_TOKENS))
    page.send_message(LONG_PROMPT)
    page.wait_reply(0, streaming(2))
    page.record_states()
    first_worker = server.kill_worker()

    lost = page.wait_reply(0, lambda r: r["state"] == "error", 30)
    assert lost["error_code"] == "engine_dead", lost
    page.wait_ready(120)
    states = page.states()
    assert "restarting/open" in states, states  # shown while the engine was down
    assert states[-1] == "running/open", states
    notes = page.driver.find_elements("css selector", "#log .note")
    assert [n.text for n in notes] == ["The engine is running again."]
    assert page.driver.execute_script("return window.samePage") == "yes"  # never reloaded
    assert server.worker_pid() != first_worker
    server.wait_for(r"restarting it \(1 of at most")

    page.fill("max-tokens", "16")
    page.send_message("Hello again!")
    back = page.wait_reply(1, lambda r: r["state"] == "done")
    assert back["finish_reason"] in ("stop", "length") and back["text"].strip(), back
    assert console_errors(page.driver, allowed=(HEALTH_503,)) == []
