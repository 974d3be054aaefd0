"""Cluster files: what one device, its node and the network between nodes can do.

    cluster = load_cluster("clusters/a100_80gb.toml")
    cluster.device.gemm_flops, cluster.links["network"].bandwidth, cluster.codecs["int8"]

A cluster file is TOML (every rate in bytes or FLOPs per second, every time in seconds):

    name = "..."
    [node]      ranks_per_node (one rank per device), memory_bytes (of one device)
    [device]    gemm_flops (achieved, float32 matmuls), gemm_bandwidth (a GEMM's operand
                bytes; 0 = not counted), gemm_call_s (per matmul call), mem_bandwidth
                (elementwise work), optimizer_bandwidth (the optimizer's bytes / s),
                op_overhead_s (per layer call), step_overhead_s (per step: bookkeeping, the
                metrics), base_memory_bytes (a rank's runtime: interpreter, libraries, MPI),
                host_copy_bandwidth (0 = arrays on the host; else the gradient ring runs on host
                copies made across this link)
    [links.node]     alpha_s, bandwidth             (two ranks on one node)
    [links.network]  alpha_s, bandwidth, node_bandwidth  (one flow; everything leaving a node)
    [codecs.NAME]    encode, decode                 (float32 input bytes per second)

A missing or ill-typed field is a ClusterError naming it (the CLI prints it and exits 2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.comm.codecs import CODECS
from mpihybrid.files import write_atomic


class ClusterError(ValueError):
    """A cluster file that cannot be used: one line saying which field and why."""


@dataclass(frozen=True)
class Node:
    ranks_per_node: int
    memory_bytes: float


@dataclass(frozen=True)
class Device:
    gemm_flops: float
    gemm_bandwidth: float
    gemm_call_s: float
    mem_bandwidth: float
    optimizer_bandwidth: float
    op_overhead_s: float
    step_overhead_s: float
    base_memory_bytes: float
    host_copy_bandwidth: float


@dataclass(frozen=True)
class Link:
    alpha_s: float
    bandwidth: float
    node_bandwidth: float = 0.0  # network only: the node's total off-node rate (0 = no cap)

    def seconds(self, nbytes: float, flows: int = 1) -> float:
        """One message of `nbytes` while `flows` messages share the node's way out."""
        rate = self.bandwidth
        if self.node_bandwidth and flows > 0:
            rate = min(rate, self.node_bandwidth / flows)
        return self.alpha_s + nbytes / rate


@dataclass(frozen=True)
class CodecRate:
    encode: float
    decode: float


@dataclass(frozen=True)
class Cluster:
    name: str
    node: Node
    device: Device
    links: dict[str, Link]
    codecs: dict[str, CodecRate]


def _section(table: dict, where: str, cls: type, optional: tuple[str, ...] = ()):
    """Build `cls` from table[where...]: every field present, a number >= 0."""
    values = {}
    for f in fields(cls):
        if f.name not in table:
            if f.name in optional:
                continue
            raise ClusterError(f"missing field {where}.{f.name}")
        value = table[f.name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClusterError(f"{where}.{f.name} = {value!r}: expected a number")
        if value < 0:
            raise ClusterError(f"{where}.{f.name} = {value!r}: must be >= 0")
        values[f.name] = value
    unknown = set(table) - {f.name for f in fields(cls)}
    if unknown:
        raise ClusterError(f"unknown field {where}.{sorted(unknown)[0]}")
    return cls(**values)


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ClusterError(f"missing section [{where}]")
    return value


def parse_cluster(data: dict) -> Cluster:
    """A Cluster from a parsed TOML table; ClusterError on the first bad or missing field."""
    if not isinstance(data.get("name"), str):
        raise ClusterError("missing field name (a string)")
    node = _section(_table(data, "node", "node"), "node", Node)
    if node.ranks_per_node < 1 or node.ranks_per_node != int(node.ranks_per_node):
        raise ClusterError(f"node.ranks_per_node = {node.ranks_per_node}: an integer >= 1")
    device = _section(_table(data, "device", "device"), "device", Device)
    for name in ("gemm_flops", "mem_bandwidth", "optimizer_bandwidth"):
        if getattr(device, name) <= 0:
            raise ClusterError(f"device.{name} = {getattr(device, name)}: must be > 0")
    links_table = _table(data, "links", "links")
    links = {
        name: _section(
            _table(links_table, name, f"links.{name}"),
            f"links.{name}",
            Link,
            optional=("node_bandwidth",),
        )
        for name in ("node", "network")
    }
    codecs_table = _table(data, "codecs", "codecs")
    codecs = {
        name: _section(_table(codecs_table, name, f"codecs.{name}"), f"codecs.{name}", CodecRate)
        for name in CODECS
    }
    for where, item in [*(("links." + k, v) for k, v in links.items()),
                        *(("codecs." + k, v) for k, v in codecs.items())]:  # fmt: skip
        for f in fields(item):
            if f.name != "node_bandwidth" and f.name != "alpha_s" and getattr(item, f.name) <= 0:
                raise ClusterError(f"{where}.{f.name} = {getattr(item, f.name)}: must be > 0")
    return Cluster(
        name=data["name"],
        node=Node(int(node.ranks_per_node), node.memory_bytes),
        device=device,
        links=links,
        codecs=codecs,
    )


def load_cluster(path: str | Path) -> Cluster:
    p = Path(path)
    if not p.is_file():
        raise ClusterError(f"cluster file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClusterError(f"cluster file {str(p)!r} is not valid TOML: {exc}") from None
    try:
        return parse_cluster(data)
    except ClusterError as exc:
        raise ClusterError(f"cluster file {str(p)!r}: {exc}") from None


def cluster_toml(cluster: Cluster, notes: dict[str, str] | None = None) -> str:
    """The cluster as TOML; `notes` puts a comment after a field ("device.gemm_flops": why)."""
    notes = notes or {}

    def lines(where: str, obj) -> list[str]:
        out = [f"[{where}]"]
        for key, value in asdict(obj).items():
            note = notes.get(f"{where}.{key}")
            text = f"{key} = {value:.6g}" if isinstance(value, float) else f"{key} = {value}"
            out.append(f"{text}  # {note}" if note else text)
        return out + [""]

    out = [f"name = {cluster.name!r}".replace("'", '"'), ""]
    out += lines("node", cluster.node) + lines("device", cluster.device)
    for name, link in cluster.links.items():
        out += lines(f"links.{name}", link)
    for name, rate in cluster.codecs.items():
        out += lines(f"codecs.{name}", rate)
    return "\n".join(out)


def write_cluster(path: str | Path, cluster: Cluster, header: str, notes: dict) -> None:
    text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_atomic(path, text + cluster_toml(cluster, notes), overwrite=True)
