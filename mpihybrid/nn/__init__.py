"""The network: layers as forward/backward pairs, GPT blocks, models split into stages, the
optimizers over flat buffers and the data (teacher and token tasks)."""
