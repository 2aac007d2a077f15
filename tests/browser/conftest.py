"""Fixtures for the browser tests: ``legato serve`` as a real subprocess, headless Chromium.

Chromium and its driver are Debian's (``chromium``, ``chromium-driver``), driven by
selenium; ``scripts/test-browser.sh`` installs them. Every test gets a fresh
browser profile. selenium is imported lazily, so the default test run (which
deselects the ``browser`` marker) does not need it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # without these Chromium calls home, and a closed network refuses it
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1200,1040",
]
START_SECONDS = 120.0
"""How long ``legato serve`` may take to start (the worker loads the model)."""


class ServeProcess:
    """``legato serve`` in a subprocess on free ports; its output is collected line by line."""

    def __init__(self, model: str | None, *flags: str) -> None:
        """``model`` None: the embedded default model, as ``legato serve`` with no model."""
        command = [
            sys.executable, "-m", "legato.cli", "serve", *([model] if model else []),
            "--port", "0", "--ws-port", "0",
            "--executor", "process", "--max-model-len", "1024", "--disable-log-stats",
            "--shutdown-grace", "1", *flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        match = self.wait_for(r"listening on (http://\S+) and (ws://\S+)", START_SECONDS)
        self.http_url, self.ws_url = match.group(1), match.group(2)
        self.port = int(self.http_url.rsplit(":", 1)[1])
        self.ws_port = int(self.ws_url.rsplit(":", 1)[1])

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<exited>")
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, seconds: float = 60.0) -> re.Match[str]:
        """The first output line matching ``pattern``; fails after ``seconds`` or on exit."""
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            for line in self.lines:
                if (match := regex.search(line)) is not None:
                    return match
            if self.lines and self.lines[-1] == "<exited>":
                raise AssertionError(f"legato serve exited; output:\n{self.output}")
            return None

        with self._changed:
            match = self._changed.wait_for(found, timeout=seconds)
        assert match is not None, f"no line matching {pattern!r}; output:\n{self.output}"
        return match

    def worker_pid(self) -> int:
        """The engine's worker process (the one child of the server)."""
        (worker,) = psutil.Process(self.process.pid).children()
        return worker.pid

    def kill_worker(self) -> int:
        pid = self.worker_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.http_url + path, timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(10)


@pytest.fixture(scope="session")
def chat_model(smollm2_dir: Path) -> str | None:
    """The model the browser chats with: the real default model (None), SmolLM2-135M-Instruct.

    ``smollm2_dir`` converts it once into the session's ``$LEGATO_HOME``, which the
    ``legato serve`` subprocesses inherit: they start from it without converting.
    """
    return None


@pytest.fixture
def serve(chat_model: str | None) -> Iterator[Callable[..., ServeProcess]]:
    """Start ``legato serve`` on ``chat_model`` with extra flags; stopped after the test."""
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        server = ServeProcess(chat_model, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Headless Chromium with a fresh profile; the console log is kept (``get_log("browser")``)."""
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not look anything up
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            pytest.fail(f"{path} is missing: run scripts/test-browser.sh (it installs Chromium)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="legato-chromium-") as profile:
        for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


def console_errors(driver: Any, allowed: tuple[str, ...] = ()) -> list[str]:
    """SEVERE console messages not matching any of ``allowed`` (regular expressions)."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and not any(re.search(a, entry["message"]) for a in allowed)
    ]


REPLIES_JS = """
return [...document.querySelectorAll('#log li.msg.assistant')].map((li) => ({
  id: li.dataset.requestId,
  state: li.dataset.state,
  text: li.querySelector('.text').textContent,
  frames: Number(li.dataset.frames || 0),
  finish_reason: li.dataset.finishReason || null,
  error_code: li.dataset.errorCode || null,
  ttft_ms: li.dataset.ttftMs === undefined ? null : Number(li.dataset.ttftMs),
  tokens_per_s: li.dataset.tokensPerS === undefined ? null : Number(li.dataset.tokensPerS),
  meta: li.querySelector('.meta').textContent,
  error: li.querySelector('.error') ? li.querySelector('.error').textContent : null,
}));
"""

RECORD_STATES_JS = """
window.legatoStates = [];
const status = document.getElementById('status');
new MutationObserver(() => {
  const seen = status.dataset.engine + '/' + status.dataset.connection;
  if (window.legatoStates.at(-1) !== seen) window.legatoStates.push(seen);
}).observe(status, {attributes: true});
"""


CONTRAST_JS = """
const parse = (color) => {
  const m = color.match(/rgba?\\(([^)]+)\\)/);
  if (!m) return null;
  const p = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number);
  return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1};
};
const luminance = ({r, g, b}) => {
  const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
};
const background = (el) => {
  for (let e = el; e; e = e.parentElement) {
    const c = parse(getComputedStyle(e).backgroundColor);
    if (c && c.a > 0) return c;
  }
  return parse(getComputedStyle(document.documentElement).backgroundColor) || {r: 255, g: 255, b: 255};
};
const problems = [];
for (const el of document.querySelectorAll('body *')) {
  if (!el.checkVisibility() || el.closest('[hidden]')) continue;
  if (![...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim())) continue;
  const [hi, lo] = [luminance(parse(getComputedStyle(el).color)), luminance(background(el))]
    .sort((x, y) => y - x);
  const ratio = (hi + 0.05) / (lo + 0.05);
  if (ratio < 4.5) {
    problems.push(`${el.tagName}#${el.id}.${el.className} ${ratio.toFixed(2)}: ${el.textContent.trim().slice(0, 40)}`);
  }
}
return problems;
"""


class ChatPage:
    """The chat page in a browser, driven as a user would (keys and clicks); read from the DOM."""

    def __init__(self, driver: WebDriver) -> None:
        self.driver = driver

    def open(self, url: str) -> None:
        self.driver.get(url)
        self.wait(lambda: self.element("status").get_attribute("data-engine") != "unknown")

    def wait(self, condition: Callable[[], Any], seconds: float = 60.0, what: str = "") -> Any:
        """Wait until ``condition()`` is truthy (checked every 50 ms); its value."""
        from selenium.webdriver.support.wait import WebDriverWait

        def check(_: Any) -> Any:
            return condition()

        message = f"{what or condition}: {self.status()} {self.replies()}"
        return WebDriverWait(self.driver, seconds, poll_frequency=0.05).until(check, message)

    def element(self, element_id: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def status(self) -> dict[str, Any]:
        status = self.element("status")
        banner = self.element("banner")
        return {
            "engine": status.get_attribute("data-engine"),
            "connection": status.get_attribute("data-connection"),
            "text": status.text,
            "banner": None if not banner.is_displayed() else banner.text,
            "banner_kind": banner.get_attribute("data-kind"),
        }

    def wait_ready(self, seconds: float = 60.0) -> None:
        def ready() -> bool:
            status = self.status()
            return status["engine"] == "running" and status["connection"] == "open"

        self.wait(ready, seconds, "engine running and connected")

    def replies(self) -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = self.driver.execute_script(REPLIES_JS)
        return replies

    def reply(self, index: int) -> dict[str, Any]:
        return self.replies()[index]

    def wait_reply(
        self, index: int, condition: Callable[[dict[str, Any]], bool], seconds: float = 120.0
    ) -> dict[str, Any]:
        def met() -> dict[str, Any] | None:
            replies = self.replies()
            if len(replies) > index and condition(replies[index]):
                return replies[index]
            return None

        reply: dict[str, Any] = self.wait(met, seconds, f"reply {index}")
        return reply

    def fill(self, element_id: str, text: str) -> None:
        """Replace a field's text by typing (select all, then the new text)."""
        from selenium.webdriver.common.keys import Keys

        field = self.element(element_id)
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys(Keys.BACKSPACE)
        if text:
            field.send_keys(text)

    def send_message(self, text: str) -> None:
        """Type ``text`` in the message box and press Enter."""
        from selenium.webdriver.common.keys import Keys

        self.element("prompt").send_keys(text, Keys.ENTER)

    def press(self, *keys: str) -> None:
        """Keys to whatever has the focus."""
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(self.driver).send_keys(*keys).perform()

    def focused_id(self) -> str:
        focused: str = self.driver.execute_script("return document.activeElement.id")
        return focused

    def contrast_problems(self) -> list[str]:
        """Visible text whose contrast with its background is under WCAG AA's 4.5:1."""
        problems: list[str] = self.driver.execute_script(CONTRAST_JS)
        return problems

    def color_scheme(self, scheme: str) -> None:
        """Emulate ``prefers-color-scheme: scheme`` ("light" or "dark")."""
        features = [{"name": "prefers-color-scheme", "value": scheme}]
        self.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": features})

    def tab_order(self, stops: int) -> list[str]:
        """The ids of the next ``stops`` elements Tab moves the focus to."""
        from selenium.webdriver.common.keys import Keys

        order = []
        for _ in range(stops):
            self.press(Keys.TAB)
            order.append(self.focused_id())
        return order

    def record_states(self) -> None:
        """From now on, keep every engine/connection state the status shows (``states()``)."""
        self.driver.execute_script(RECORD_STATES_JS)

    def states(self) -> list[str]:
        states: list[str] = self.driver.execute_script("return window.legatoStates")
        return states


@pytest.fixture
def page(browser: WebDriver) -> ChatPage:
    return ChatPage(browser)
