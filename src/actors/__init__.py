"""legato.actors."""
