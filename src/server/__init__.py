"""legato.server: the OpenAI-compatible HTTP API, the WebSocket endpoint, and ``legato serve``.

``open_server(engine, settings)`` serves an engine you opened yourself;
``serve(model, engine_args, settings)`` is the whole ``legato serve``.
"""

from .app import Server, open_server, serve
from .state import ServerSettings

__all__ = ["Server", "ServerSettings", "open_server", "serve"]
