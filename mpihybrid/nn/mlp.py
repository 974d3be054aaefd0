"""The MLP's blocks: `depth - 1` hidden blocks [Linear, (LayerNorm), activation], then the head.

Its entry in the registry of model kinds is `kinds.MLP` (teacher data, one row per sample).
"""

from __future__ import annotations

from mpihybrid.nn.layers import GELU, Layer, LayerNorm, Linear, ReLU
from mpihybrid.nn.settings import Setting

# B = rows of a micro-batch, C = features, K = classes

Block = list[Layer]

ACTIVATIONS = {"relu": ReLU, "gelu": GELU}

# model.* keys an mlp reads beyond every kind's (nn/settings.py); hidden: every hidden layer's
# width, depth: its Linear layers, the head included
MLP_SETTINGS = (
    Setting("activation", "relu", "the hidden layers' activation", choices=tuple(ACTIVATIONS)),
    Setting("norm", False, "LayerNorm after each hidden Linear"),
)


def mlp_blocks(cfg, in_features: int, num_classes: int) -> list[Block]:
    """`depth - 1` hidden blocks [Linear, (LayerNorm), act], then the head.

    `cfg` needs: hidden, depth (number of Linear layers), activation, norm.
    """
    if cfg.depth < 1:
        raise ValueError(f"model.depth = {cfg.depth}: need at least 1 Linear layer")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(
            f"model.activation = {cfg.activation!r}: choose one of {sorted(ACTIVATIONS)}"
        )
    blocks: list[Block] = []
    width = in_features
    for _ in range(cfg.depth - 1):
        block: Block = [Linear(width, cfg.hidden)]
        if cfg.norm:
            block.append(LayerNorm(cfg.hidden))
        block.append(ACTIVATIONS[cfg.activation]())
        blocks.append(block)
        width = cfg.hidden
    blocks.append([Linear(width, num_classes)])
    return blocks
