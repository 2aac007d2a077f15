"""The engine's figures: per-step records, the stat loggers and their collector.

Synchronous; never imports trio or torch."""
