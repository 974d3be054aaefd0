"""A training run: the loop (loop.train), what it is built from (build, state), what it records
(summary), its evaluations, trace, step line, checkpoints and the end-of-run report."""
