"""Which hosts and which web origins may reach the server: DNS rebinding and cross-site
WebSockets (issue 26: F6, F8).

* ``Host`` (both ports): a page that rebinds its own name to 127.0.0.1 becomes
  same-origin with the server, so no Origin or CORS check can stop it; its
  requests still carry the attacker's name in ``Host``. Allowed: the loopback
  names (``localhost`` and ``*.localhost``, ``127.0.0.1``, ``::1``), the bound
  ``--host``, ``--allowed-hosts`` (``*`` turns the check off) and, when bound to
  every interface (``0.0.0.0`` / ``::``), any IP address literal (a rebinding needs
  a name). Any port. A request without ``Host`` (HTTP/1.0) is allowed.
* ``Origin`` (WebSocket): browsers let any page open a WebSocket to any server
  and send its own origin. Allowed: no ``Origin`` (not a browser), the chat page's
  own origin (an allowed host that is a name of this server, on the HTTP port)
  and ``--allowed-origins`` (``*``: any; a page behind a proxy needs its origin here).
  ``Origin: null`` (sandboxed frames, ``file:`` pages) is refused.

Pure code; never imports trio.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` (``[v6]:port`` too) as a lowercase host and its port; None if malformed."""
    try:
        parts = urlsplit("//" + value.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if host is None or parts.username is not None or parts.path or parts.query:
        return None
    return host.lower().rstrip("."), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SiteGuard:
    """The Host and WebSocket Origin allowlists of one server."""

    bound_host: str = "127.0.0.1"
    http_port: int = 8000
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @functools.cached_property
    def _names(self) -> frozenset[str]:
        """Hosts that name this server (for its own origin); computed once per guard, not
        per request."""
        bound = self.bound_host.strip("[]").lower()
        extra = {h.lower() for h in self.allowed_hosts if h != "*"}
        names = LOOPBACK_NAMES | extra
        return names if bound in WILDCARD_HOSTS else names | {bound}

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request with this ``Host`` header may be served."""
        if host_header is None or "*" in self.allowed_hosts:
            return True
        parsed = split_host(host_header)
        if parsed is None:
            return False
        host = parsed[0]
        if host in self._names or host.endswith(".localhost"):
            return True
        return self.bound_host.strip("[]") in WILDCARD_HOSTS and _is_ip(host)

    def ws_origin_allowed(self, origin: str | None) -> bool:
        """Whether a WebSocket handshake with this ``Origin`` header may be accepted."""
        if origin is None:
            return True  # not a browser
        origin = origin.strip()
        if origin == "null":
            return False
        if "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            return False
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        host = parts.hostname.lower()
        own = host in self._names or host.endswith(".localhost")
        return own and port == self.http_port
