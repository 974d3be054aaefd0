"""How the pipeline's tensors travel between stages: as float32, or encoded (comm.p2p_codec).

    wire = P2PWire.build("bf16", encoded_peers={1})   # pp ranks whose link is encoded
    wire.encodes(peer)                                 # this link carries codec bytes
    codec = wire.codec_for(shape)                      # int8: one absmax scale per row

The gradient ring's codecs (comm.codecs; numba kernels with the `fast` extra) on activations and
activation gradients: the sender encodes the tensor once into a preallocated byte buffer, the
receiver decodes it into the float32 buffer its forward or backward reads, so nothing past the
receive changes. A row is a tensor's last axis (a token's or a sample's features): int8 keeps
one float32 scale per row, its absmax (comm.codecs' int8 with the block set to the row's width).
Which links: comm.p2p_codec_scope = "inter-node" (default) encodes the links whose two ranks MPI
puts on different nodes (comm.nodes), "all" every link. fp32 leaves every link as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpihybrid.comm.codecs import CODECS, Codec, get_codec

P2P_CODECS = CODECS
P2P_SCOPES = ("inter-node", "all")


@dataclass
class P2PWire:
    name: str = "fp32"
    encoded_peers: frozenset[int] = frozenset()  # pp ranks whose link carries codec bytes
    _codecs: dict[int, Codec] = field(default_factory=dict)

    @classmethod
    def build(cls, name: str, encoded_peers=()) -> P2PWire:
        if name not in P2P_CODECS:
            raise ValueError(f"p2p codec must be one of {', '.join(P2P_CODECS)}, got {name!r}")
        peers = frozenset(encoded_peers) if name != "fp32" else frozenset()
        return cls(name, peers)

    def encodes(self, peer: int) -> bool:
        return peer in self.encoded_peers

    def codec_for(self, shape: tuple[int, ...]) -> Codec:
        """The codec of a tensor of `shape` (int8's scale block: one row, the last axis)."""
        row = max(int(shape[-1]) if shape else 1, 1)
        if row not in self._codecs:
            self._codecs[row] = get_codec(self.name, block=row)
        return self._codecs[row]


def encoded_peers(
    scope: str, my_world: int, peer_world: list[int], nodes: list[int] | None
) -> set[int]:
    """The pp ranks (index into peer_world, their world ranks) whose link is encoded."""
    if scope not in P2P_SCOPES:
        raise ValueError(f"p2p scope must be one of {', '.join(P2P_SCOPES)}, got {scope!r}")
    return {
        p
        for p, w in enumerate(peer_world)
        if w != my_world and (scope == "all" or (nodes is not None and nodes[w] != nodes[my_world]))
    }
