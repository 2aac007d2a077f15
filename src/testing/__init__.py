"""legato.testing."""
