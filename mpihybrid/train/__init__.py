"""A training run: the loop (loop.train), checkpoints and the end-of-run report."""
