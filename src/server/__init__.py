"""legato.server."""
