"""Testing aids shipped with legato: chaos hooks, the null-model runner, a worker's input frames."""
