"""Testing aids shipped with legato: chaos hooks and the null-model runner."""
