// legato's chat page: a client of the WebSocket endpoint (docs/websocket.md), no build step.
//
// One WebSocket connection carries every answer: each message is a `generate`
// frame with its own request id, so a second message may stream while the
// first one does. Stop sends an `abort` frame; the server ends the request and
// its last frame says finish_reason "abort". The engine's state comes from two
// places: error frames (`engine_dead`, `engine_restarting`) and GET /health,
// polled every few seconds, which also tells when a restarted engine is back.
// Model text is only ever set as text (never as HTML).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    skipLink: $("skip-link"),
    status: $("status"),
    statusText: $("status-text"),
    banner: $("banner"),
    log: $("log"),
    empty: $("empty"),
    composer: $("composer"),
    prompt: $("prompt"),
    stop: $("stop"),
    newChat: $("new-chat"),
    system: $("system"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
    apiKey: $("api-key"),
    keyRequired: $("key-required"),
    wsUrl: $("ws-url"),
    connection: $("connection"),
    model: $("model-name"),
  };

  const HEALTH_POLL_MS = { running: 4000, otherwise: 1000 };
  const RECONNECT_MAX_MS = 4000;

  let config = null; // /ui/config.json: {model, ws_port, ws_url, api_key_required}
  let ws = null;
  let connection = "closed"; // connecting | open | closed | need_key | auth_failed
  let connectionDetail = "";
  let engine = "unknown"; // running | dead | restarting | shutting_down | unreachable | unknown
  let engineDetail = "";
  let reconnectDelay = 250;
  let reconnectTimer = null;
  let healthTimer = null;
  let counter = 0;
  let notice = "";
  const live = new Map(); // request id -> Reply still streaming
  let turns = []; // the conversation: {role, content, done}

  // ---------------------------------------------------------------- state display

  const ENGINE_TEXT = {
    running: "Engine running",
    dead: "Engine dead",
    restarting: "Engine restarting…",
    shutting_down: "Server shutting down",
    unreachable: "Server unreachable",
    unknown: "Checking the engine…",
  };
  const CONNECTION_TEXT = {
    connecting: "connecting…",
    open: "connected",
    closed: "disconnected",
    need_key: "API key needed",
    auth_failed: "API key refused",
  };

  function render() {
    ui.status.dataset.engine = engine;
    ui.status.dataset.connection = connection;
    ui.statusText.textContent = `${ENGINE_TEXT[engine]} · ${CONNECTION_TEXT[connection]}`;
    const [kind, title, detail] = bannerFor();
    ui.banner.hidden = !kind;
    if (!kind) {
      ui.banner.replaceChildren();
      delete ui.banner.dataset.kind;
      return;
    }
    if (ui.banner.dataset.kind === kind && ui.banner.dataset.title === title + detail) return;
    ui.banner.dataset.kind = kind;
    ui.banner.dataset.title = title + detail;
    const strong = document.createElement("span");
    strong.textContent = title;
    const rest = document.createElement("span");
    rest.className = "detail";
    rest.textContent = detail;
    ui.banner.replaceChildren(strong, rest);
  }

  function sentence(text) {
    const trimmed = text.trim();
    return !trimmed || /[.!?]$/.test(trimmed) ? trimmed : `${trimmed}.`;
  }

  function cause(message) {
    // the server's messages may repeat "the engine is dead: " before the cause itself
    return sentence((message || "").replace(/^(the engine is dead:\s*)+/i, ""));
  }

  const ERROR_TEXT = {
    engine_dead: "The engine died before this answer ended.",
    engine_restarting: "The engine is restarting: send again in a moment.",
    connection_closed: "The connection closed before this answer ended.",
    shutting_down: "The server is shutting down.",
  };

  function bannerFor() {
    if (engine === "dead") {
      return ["dead", "The engine is dead.",
        `${cause(engineDetail)} Answers in progress were lost. Restart the server (or run it ` +
        "with --restart-on-failure); this page reconnects by itself."];
    }
    if (engine === "restarting") {
      return ["restarting", "The engine died and is restarting…",
        "Answers in progress were lost. You can send again as soon as it is back; no reload needed."];
    }
    if (engine === "shutting_down") return ["dead", "The server is shutting down.", ""];
    if (engine === "unreachable") return ["dead", "The server does not answer.", "Retrying…"];
    if (connection === "need_key") {
      return ["info", "This server needs an API key.", "Enter it under Connection, then press Connect."];
    }
    if (connection === "auth_failed") {
      return ["dead", "The API key was refused.", "Enter the right key under Connection, then press Connect."];
    }
    if (connection === "closed" && config) {
      return ["info", "The WebSocket connection is closed.", `${connectionDetail} Reconnecting to ${ui.wsUrl.value}…`];
    }
    if (notice) return ["info", notice, ""];
    return [null, "", ""];
  }

  function setEngine(state, detail = "") {
    const was = engine;
    engine = state;
    engineDetail = detail;
    if (state === "running" && (was === "dead" || was === "restarting")) {
      addNote("The engine is running again.");
    }
    if (state !== was) scheduleHealth();
    render();
  }

  function setConnection(state, detail = "") {
    connection = state;
    connectionDetail = detail;
    render();
  }

  function setNotice(text) {
    notice = text;
    render();
  }

  // ---------------------------------------------------------------- health

  async function checkHealth() {
    clearTimeout(healthTimer);
    try {
      const response = await fetch("/health", { cache: "no-store" });
      if (response.ok) {
        setEngine("running");
      } else {
        let code = "";
        let message = `HTTP ${response.status}`;
        try {
          const body = await response.json();
          code = body.error.code;
          message = body.error.message;
        } catch (_) {
          // not OpenAI's error body: keep the status
        }
        const states = { engine_restarting: "restarting", shutting_down: "shutting_down" };
        setEngine(states[code] || "dead", message);
      }
    } catch (_) {
      setEngine("unreachable");
    }
    scheduleHealth();
  }

  function scheduleHealth(ms) {
    clearTimeout(healthTimer);
    const wait = ms ?? (engine === "running" ? HEALTH_POLL_MS.running : HEALTH_POLL_MS.otherwise);
    healthTimer = setTimeout(checkHealth, wait);
  }

  // ---------------------------------------------------------------- the connection

  function defaultWsUrl() {
    if (config.ws_url) return config.ws_url;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return `${scheme}//${location.hostname}:${config.ws_port}/`; // hostname keeps IPv6 brackets
  }

  function connect() {
    clearTimeout(reconnectTimer);
    if (ws) {
      const old = ws;
      ws = null;
      old.close(1000, "reconnecting");
      failLive("connection_closed", "the connection was replaced before the answer ended");
    }
    const key = ui.apiKey.value;
    ui.apiKey.removeAttribute("aria-invalid");
    if (config.api_key_required && !key) {
      ui.apiKey.setAttribute("aria-invalid", "true");
      setConnection("need_key");
      return;
    }
    let socket;
    try {
      socket = new WebSocket(ui.wsUrl.value.trim());
    } catch (error) {
      ui.wsUrl.setAttribute("aria-invalid", "true");
      setConnection("closed", `Not a WebSocket URL: ${error.message}.`);
      return;
    }
    ui.wsUrl.removeAttribute("aria-invalid");
    ws = socket;
    setConnection("connecting");
    socket.onopen = () => {
      if (key) socket.send(JSON.stringify({ type: "auth", api_key: key })); // success is silent
      reconnectDelay = 250;
      setConnection("open");
    };
    socket.onmessage = (event) => {
      if (typeof event.data === "string") onFrame(JSON.parse(event.data));
    };
    socket.onclose = (event) => {
      if (ws !== socket) return; // replaced on purpose
      ws = null;
      failLive("connection_closed", "the WebSocket connection closed before the answer ended");
      if (event.code === 1008) {
        ui.apiKey.setAttribute("aria-invalid", "true");
        setConnection("auth_failed");
        return; // a wrong key stays wrong: wait for Connect
      }
      setConnection("closed", event.code === 1001 ? "The server went away." : "");
      reconnectTimer = setTimeout(connect, reconnectDelay);
      reconnectDelay = Math.min(reconnectDelay * 2, RECONNECT_MAX_MS);
      scheduleHealth(0);
    };
  }

  function onFrame(frame) {
    const reply = typeof frame.request_id === "string" ? live.get(frame.request_id) : undefined;
    if (frame.type === "output") {
      if (reply) reply.output(frame);
      return;
    }
    if (frame.type !== "error") return;
    if (reply) reply.fail(frame.code, frame.message);
    if (frame.code === "engine_dead") {
      setEngine("dead", frame.message);
      scheduleHealth(0); // under --restart-on-failure, /health soon says "restarting"
    } else if (frame.code === "engine_restarting") {
      setEngine("restarting", frame.message);
    } else if (frame.code === "shutting_down") {
      setEngine("shutting_down", frame.message);
    } else if (frame.code === "unauthorized") {
      setConnection("auth_failed");
    } else if (!reply) {
      setNotice(`${frame.code}: ${frame.message}`);
    }
  }

  // ---------------------------------------------------------------- the conversation

  function scroller() {
    // wide screens scroll the log alone; narrow ones (one column) the whole page
    return getComputedStyle(ui.log).overflowY === "auto" ? ui.log : document.scrollingElement;
  }

  function scrolledToEnd() {
    const s = scroller();
    return s.scrollHeight - s.scrollTop - s.clientHeight < 40;
  }

  function scrollToEnd() {
    const s = scroller();
    s.scrollTop = s.scrollHeight;
  }

  function append(item) {
    const follow = scrolledToEnd();
    ui.empty.hidden = true;
    ui.log.append(item);
    if (follow) scrollToEnd();
  }

  function paragraph(className, text = "") {
    const p = document.createElement("p");
    p.className = className;
    p.textContent = text;
    return p;
  }

  function addUserMessage(text) {
    const item = document.createElement("li");
    item.className = "msg user";
    item.append(paragraph("who", "You"), paragraph("text", text));
    append(item);
    turns.push({ role: "user", content: text, done: true });
  }

  function addNote(text) {
    const item = document.createElement("li");
    item.className = "note hint";
    item.textContent = text;
    append(item);
  }

  class Reply {
    constructor(requestId) {
      this.id = requestId;
      this.sentAt = performance.now();
      this.firstAt = null;
      this.lastAt = null;
      this.tokens = 0;
      this.firstTokens = 0;
      this.frames = 0;
      this.text = "";
      this.finishReason = null;
      this.turn = { role: "assistant", content: "", done: false };
      turns.push(this.turn);

      this.item = document.createElement("li");
      this.item.className = "msg assistant";
      this.item.dataset.requestId = requestId;
      this.item.dataset.state = "streaming";
      this.item.setAttribute("aria-busy", "true"); // read out once complete
      this.textEl = paragraph("text");
      this.stats = document.createElement("span");
      this.stats.className = "stats";
      this.stats.textContent = "waiting for the first token…";
      this.finishEl = document.createElement("span");
      this.finishEl.className = "finish";
      this.stopButton = document.createElement("button");
      this.stopButton.type = "button";
      this.stopButton.className = "stop-one";
      this.stopButton.textContent = "Stop";
      this.stopButton.setAttribute("aria-label", "Stop this answer");
      this.stopButton.addEventListener("click", () => this.stop());
      const meta = document.createElement("p");
      meta.className = "meta";
      meta.append(this.stats, this.finishEl, this.stopButton);
      this.item.append(paragraph("who", config.shortModel), this.textEl, meta);
      append(this.item);
      live.set(requestId, this);
      updateStop();
    }

    output(frame) {
      const now = performance.now();
      this.frames += 1;
      const count = Array.isArray(frame.token_ids) ? frame.token_ids.length : 0;
      if (count > 0) {
        if (this.firstAt === null) {
          this.firstAt = now;
          this.firstTokens = count;
        }
        this.lastAt = now;
        this.tokens += count;
      }
      if (frame.text) {
        const follow = scrolledToEnd();
        this.text += frame.text;
        this.textEl.append(frame.text);
        if (follow) scrollToEnd();
      }
      if (frame.finish_reason) this.finishReason = frame.finish_reason;
      this.item.dataset.frames = String(this.frames);
      this.showStats();
      if (frame.finished) {
        if (frame.usage) this.tokens = frame.usage.completion_tokens;
        this.end(this.finishReason === "abort" ? "stopped" : "done");
      }
    }

    showStats() {
      const parts = [`${this.tokens} ${this.tokens === 1 ? "token" : "tokens"}`];
      if (this.firstAt !== null) {
        const ttft = this.firstAt - this.sentAt;
        this.item.dataset.ttftMs = ttft.toFixed(0);
        parts.push(`TTFT ${ttft.toFixed(0)} ms`);
      }
      if (this.lastAt !== null && this.lastAt > this.firstAt) {
        // the decode rate: tokens after the first frame over the time since it
        const rate = (this.tokens - this.firstTokens) / ((this.lastAt - this.firstAt) / 1000);
        this.item.dataset.tokensPerS = rate.toFixed(1);
        parts.push(`${rate.toFixed(1)} tok/s`);
      }
      this.stats.textContent = parts.join(" · ");
    }

    stop() {
      if (!live.has(this.id) || !ws || ws.readyState !== WebSocket.OPEN) return;
      ws.send(JSON.stringify({ type: "abort", request_id: this.id }));
      this.stopButton.disabled = true;
      this.stopButton.textContent = "Stopping…";
    }

    end(state) {
      live.delete(this.id);
      this.item.dataset.state = state;
      this.item.setAttribute("aria-busy", "false");
      if (this.finishReason) {
        this.item.dataset.finishReason = this.finishReason;
        this.finishEl.textContent = `finish_reason: ${this.finishReason}`;
      }
      this.turn.content = this.text;
      this.turn.done = state !== "error";
      const hadFocus = document.activeElement === this.stopButton;
      this.stopButton.remove();
      if (hadFocus) ui.prompt.focus();
      updateStop();
    }

    fail(code, message) {
      this.item.dataset.errorCode = code;
      const error = paragraph("error", ERROR_TEXT[code] || `${code}:`);
      const detail = code === "engine_dead" ? cause(message) : sentence(message);
      if (detail) {
        const small = document.createElement("span");
        small.className = "detail";
        small.textContent = detail;
        error.append(" ", small);
      }
      this.item.append(error);
      this.end("error");
    }
  }

  function failLive(code, message) {
    for (const reply of [...live.values()]) reply.fail(code, message);
  }

  function updateStop() {
    const hadFocus = document.activeElement === ui.stop;
    ui.stop.disabled = live.size === 0;
    if (hadFocus && ui.stop.disabled) ui.prompt.focus();
  }

  function stopAll() {
    for (const reply of live.values()) reply.stop();
  }

  function readNumber(input, { integer, min, max }) {
    const value = Number(input.value);
    const ok = input.value.trim() !== "" && Number.isFinite(value) && value >= min &&
      (max === undefined || value <= max) && (!integer || Number.isInteger(value));
    if (ok) input.removeAttribute("aria-invalid");
    else input.setAttribute("aria-invalid", "true");
    return ok ? value : null;
  }

  function send() {
    const text = ui.prompt.value.trim();
    if (!text) {
      ui.prompt.focus();
      return;
    }
    const temperature = readNumber(ui.temperature, { integer: false, min: 0, max: 2 });
    const maxTokens = readNumber(ui.maxTokens, { integer: true, min: 1 });
    if (temperature === null || maxTokens === null) {
      setNotice("Temperature must be between 0 and 2, and max tokens a whole number of at least 1.");
      (temperature === null ? ui.temperature : ui.maxTokens).focus();
      return;
    }
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      setNotice("Not connected to the WebSocket endpoint: the message was not sent.");
      if (connection === "need_key" || connection === "auth_failed") ui.apiKey.focus();
      return;
    }
    setNotice("");
    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const turn of turns) {
      if (turn.done && turn.content) messages.push({ role: turn.role, content: turn.content });
    }
    messages.push({ role: "user", content: text });
    counter += 1;
    const requestId = `chat-${counter}`;
    addUserMessage(text);
    const reply = new Reply(requestId);
    ws.send(JSON.stringify({
      type: "generate",
      request_id: requestId,
      messages,
      params: { temperature, max_tokens: maxTokens },
    }));
    reply.sentAt = performance.now();
    ui.prompt.value = "";
  }

  function newChat() {
    stopAll();
    live.clear(); // their last frames are dropped
    updateStop();
    turns = [];
    ui.log.replaceChildren();
    ui.empty.hidden = false;
    setNotice("");
    ui.prompt.focus();
  }

  // ---------------------------------------------------------------- start

  function wire() {
    ui.skipLink.addEventListener("click", (event) => {
      event.preventDefault();
      ui.prompt.focus();
    });
    ui.composer.addEventListener("submit", (event) => {
      event.preventDefault();
      send();
    });
    ui.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && live.size > 0) {
        event.preventDefault();
        stopAll();
      }
    });
    ui.stop.addEventListener("click", stopAll);
    ui.newChat.addEventListener("click", newChat);
    ui.connection.addEventListener("submit", (event) => {
      event.preventDefault();
      reconnectDelay = 250;
      connect();
    });
  }

  async function loadConfig() {
    for (;;) {
      try {
        const response = await fetch("/ui/config.json", { cache: "no-store" });
        if (response.ok) {
          const value = await response.json();
          if (value.ws_port !== null || value.ws_url) return value;
        }
      } catch (_) {
        setEngine("unreachable");
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }

  async function start() {
    wire();
    render();
    config = await loadConfig();
    // a model served by its path shows its folder's name; the whole name is the title
    config.shortModel = config.model.split("/").filter(Boolean).pop() || config.model;
    ui.model.textContent = config.shortModel;
    ui.model.title = config.model;
    document.title = `${config.shortModel} · legato chat`;
    ui.keyRequired.hidden = !config.api_key_required;
    if (config.api_key_required) ui.apiKey.setAttribute("aria-required", "true");
    // Only the server's own WebSocket (or the one its operator configured): never a URL
    // from the page's address, which any link could set (it would get the key and the chat).
    ui.wsUrl.value = defaultWsUrl();
    checkHealth();
    connect();
  }

  start();
})();
