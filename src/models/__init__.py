"""legato.models."""
