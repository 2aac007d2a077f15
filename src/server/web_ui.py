"""The chat page: static files shipped in the package, served at ``/`` and ``/ui/...``.

``WebUI.routes`` maps each URL path to its handler, built once from the files
of the ``static/`` folder beside this module (read into memory at start-up).
A request path is looked up in that map as it is: no part of it ever reaches
the filesystem, so ``..``, encoded or not, cannot leave the folder; a file
whose type is not in ``CONTENT_TYPES`` is not served at all.

``/ui/config.json`` tells the page where the WebSocket endpoint is
(``ws_port``, the bound port; ``ws_url``, given by ``--web-ui-ws-url``)
and whether it needs an API key. The page and its config are public even
with ``--api-key``: the key is typed into the page and sent in the WebSocket
``auth`` frame, so the page itself cannot carry it.

Never imports torch.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .asgi import Request, dumps, send_body
from .site_guard import split_host

if TYPE_CHECKING:
    from .state import Handler, ServingState

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

PREFIX = "/ui/"
"""Where the page's files are served (``/`` is ``index.html``)."""

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; connect-src 'self' {ws}; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""The page loads nothing from elsewhere and connects only to this server's WebSocket
(``{ws}``: its port on the page's host, or ``--web-ui-ws-url``)."""


def content_security_policy(host: str | None, ws_port: int | None, ws_url: str | None) -> str:
    """The page's CSP for a request with ``Host: host`` (already allowed by the site guard)."""
    if ws_url is not None:
        parts = urlsplit(ws_url)
        sources = f"{parts.scheme}://{parts.netloc}"
    else:
        parsed = split_host(host) if host is not None else None
        name = parsed[0] if parsed is not None else "127.0.0.1"
        name = f"[{name}]" if ":" in name else name
        sources = f"ws://{name}:{ws_port} wss://{name}:{ws_port}"
    return CONTENT_SECURITY_POLICY.format(ws=sources)


_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def read_static_files() -> dict[str, tuple[bytes, str]]:
    """``{file name: (bytes, content type)}`` for every servable file of ``static/``."""
    folder = resources.files(__package__ or "legato.server") / "static"
    files = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if item.is_file() and suffix in CONTENT_TYPES:
            files[item.name] = (item.read_bytes(), CONTENT_TYPES[suffix])
    if "index.html" not in files:
        raise RuntimeError(f"the chat page is missing from the package: {folder}")
    return files


class WebUI:
    """The chat page over one server. ``ws_port`` is set once the WebSocket port is bound."""

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self.ws_port: int | None = None
        files = read_static_files()
        self.routes: dict[str, dict[str, Handler]] = {
            PREFIX + name: {"GET": self._file_handler(name, content)}
            for name, content in files.items()
        }
        self.routes["/"] = {"GET": self._file_handler("index.html", files["index.html"])}
        self.routes[PREFIX + "config.json"] = {"GET": self._config}

    def _file_handler(self, name: str, content: tuple[bytes, str]) -> Handler:
        body, content_type = content
        html = name.endswith(".html")

        async def serve_file(request: Request, state: ServingState) -> None:
            headers = list(_HEADERS)
            if html:
                csp = content_security_policy(
                    request.header("host"), self.ws_port, state.settings.web_ui_ws_url
                )
                headers.append((b"content-security-policy", csp.encode("latin-1")))
            await send_body(request.send, 200, body, content_type, headers)

        return serve_file

    async def _config(self, request: Request, state: ServingState) -> None:
        """``{"model", "ws_port", "ws_url", "api_key_required"}`` for the page."""
        settings = state.settings
        config = {
            "model": state.model_name,
            "ws_port": self.ws_port,
            "ws_url": settings.web_ui_ws_url,
            "api_key_required": settings.api_key is not None,
        }
        await send_body(request.send, 200, dumps(config), "application/json", list(_HEADERS))
