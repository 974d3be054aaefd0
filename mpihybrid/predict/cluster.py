"""Cluster files: what one device, its node and the network between nodes can do.

    cluster = load_cluster("clusters/a100_80gb.toml")
    cluster.device.gemm_flops, cluster.links["network"].bandwidth, cluster.codecs["int8"]

A cluster file is TOML (every rate in bytes or FLOPs per second, every time in seconds):

    name = "..."
    [node]      ranks_per_node (one rank per device), memory_bytes (of one device), cores
                (optional: CPU cores that run the ranks; more ranks on a node than cores share
                them, every rate slowed by ranks / cores; 0 or absent: a core per rank)
    [device]    gemm_flops (achieved, float32 matmuls), gemm_bandwidth (a GEMM's operand
                bytes; 0 = not counted), gemm_call_s (per matmul call), mem_bandwidth
                (elementwise work), optimizer_bandwidth (the optimizer's bytes / s),
                op_overhead_s (per layer call), step_overhead_s (per step: bookkeeping, the
                metrics), base_memory_bytes (a rank's runtime: interpreter, libraries, MPI),
                kernel_memory_bytes (optional: what numba's runtime adds once a job runs a
                compiled kernel: GPT layers, GELU, LayerNorm, AdamW, a lossy codec),
                host_copy_bandwidth (0 = arrays on the host; else the gradient ring runs on host
                copies made across this link)
    [links.node]     alpha_s, bandwidth             (two ranks on one node)
    [links.network]  alpha_s, bandwidth, node_bandwidth  (one flow; everything leaving a node),
                     burst_bytes (optional, 0: a shaped link's token bucket, passed at once by a
                     pipeline message after an idle link)
    [codecs.NAME]    encode, decode                 (float32 input bytes per second)

A missing, ill-typed or non-finite field, a rate <= 0, a time < 0 is a ClusterError naming it
(the CLI prints it and exits 2). Fields that may be 0: gemm_bandwidth, host_copy_bandwidth,
node_bandwidth (0 = not counted), burst_bytes, and every time and base_memory_bytes.

Cluster files install with the package (mpihybrid/clusters, the repository's clusters/): a
name finds them from any directory, after the user's own (calibrate writes there):

    find_cluster("a100_80gb")   # $XDG_CONFIG_HOME/mpihybrid/clusters/, then the package's
    find_cluster("my.toml")     # a path is a path
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.comm.codecs import CODECS
from mpihybrid.files import write_atomic
from mpihybrid.inputs import MAX_TOML_BYTES, InputFileError, read_text


class ClusterError(ValueError):
    """A cluster file that cannot be used: one line saying which field and why."""


@dataclass(frozen=True)
class Node:
    ranks_per_node: int
    memory_bytes: float
    cores: int = 0  # 0: a core (device) per rank


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
    kernel_memory_bytes: float = 0.0  # numba's runtime, resident once a job runs a compiled kernel


@dataclass(frozen=True)
class Link:
    alpha_s: float
    bandwidth: float
    node_bandwidth: float = 0.0  # network only: the node's total off-node rate (0 = no cap)
    # a shaped link's token bucket (tc tbf's burst, benchmarks/two_nodes.sh): bytes that leave
    # at once after the link has been idle long enough to refill it; 0 for a NIC
    burst_bytes: float = 0.0

    def seconds(self, nbytes: float, flows: int = 1) -> float:
        """One message of `nbytes` while `flows` messages share the node's way out."""
        rate = self.bandwidth
        if self.node_bandwidth and flows > 0:
            rate = min(rate, self.node_bandwidth / flows)
        return self.alpha_s + nbytes / rate

    def after_idle(self, nbytes: float, flows: int = 1) -> float:
        """seconds() of a message sent after the link idled (a pipeline message after a compute
        action; not a ring's hops, which follow each other): the flows share the burst."""
        return self.seconds(max(nbytes - self.burst_bytes / max(flows, 1), 0.0), flows)


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


# fields that may be 0 (not counted); every other rate must be > 0
MAY_BE_ZERO = {
    "gemm_bandwidth",
    "host_copy_bandwidth",
    "node_bandwidth",
    "base_memory_bytes",
    "cores",
    "kernel_memory_bytes",
    "burst_bytes",
}


def _section(table: dict, where: str, cls: type, optional: tuple[str, ...] = ()):
    """Build `cls` from table[where...]: every field present, a finite number; a time (`_s`)
    or a field of MAY_BE_ZERO >= 0, any other (a rate, a size) > 0."""
    values = {}
    for f in fields(cls):
        if f.name not in table:
            if f.name in optional:
                continue
            raise ClusterError(f"missing field {where}.{f.name}")
        value = table[f.name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClusterError(f"{where}.{f.name} = {value!r}: expected a number")
        if not math.isfinite(value):
            raise ClusterError(f"{where}.{f.name} = {value!r}: must be a finite number")
        if value < 0:
            raise ClusterError(f"{where}.{f.name} = {value!r}: must be >= 0")
        if value == 0 and not (f.name.endswith("_s") or f.name in MAY_BE_ZERO):
            raise ClusterError(f"{where}.{f.name} = {value!r}: must be > 0")
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
    node = _section(_table(data, "node", "node"), "node", Node, optional=("cores",))
    if node.ranks_per_node < 1 or node.ranks_per_node != int(node.ranks_per_node):
        raise ClusterError(f"node.ranks_per_node = {node.ranks_per_node}: an integer >= 1")
    device = _section(
        _table(data, "device", "device"), "device", Device, optional=("kernel_memory_bytes",)
    )
    links_table = _table(data, "links", "links")
    links = {
        name: _section(
            _table(links_table, name, f"links.{name}"),
            f"links.{name}",
            Link,
            optional=("node_bandwidth", "burst_bytes"),
        )
        for name in ("node", "network")
    }
    codecs_table = _table(data, "codecs", "codecs")
    codecs = {
        name: _section(_table(codecs_table, name, f"codecs.{name}"), f"codecs.{name}", CodecRate)
        for name in CODECS
    }
    return Cluster(
        name=data["name"],
        node=Node(int(node.ranks_per_node), node.memory_bytes, int(node.cores)),
        device=device,
        links=links,
        codecs=codecs,
    )


def shared_cores(cluster: Cluster, world: int) -> Cluster:
    """The cluster as `world` ranks see it when a node holds more of them than it has cores
    (node.cores): the cores are time-shared (MPI's waits poll, so a waiting rank keeps its
    share), every rate of the device, the codecs and the node's link slowed by ranks / cores."""
    n = cluster.node
    ranks = min(world, n.ranks_per_node)
    if not n.cores or ranks <= n.cores:
        return cluster
    k = ranks / n.cores
    d = cluster.device
    device = Device(
        gemm_flops=d.gemm_flops / k,
        gemm_bandwidth=d.gemm_bandwidth / k,
        gemm_call_s=d.gemm_call_s * k,
        mem_bandwidth=d.mem_bandwidth / k,
        optimizer_bandwidth=d.optimizer_bandwidth / k,
        op_overhead_s=d.op_overhead_s * k,
        step_overhead_s=d.step_overhead_s * k,
        base_memory_bytes=d.base_memory_bytes,
        host_copy_bandwidth=d.host_copy_bandwidth / k,
        kernel_memory_bytes=d.kernel_memory_bytes,
    )
    link = cluster.links["node"]
    links = {**cluster.links, "node": Link(link.alpha_s * k, link.bandwidth / k, 0.0)}
    codecs = {name: CodecRate(r.encode / k, r.decode / k) for name, r in cluster.codecs.items()}
    # cores 0: the sharing is in the rates now (applying this twice changes nothing)
    return Cluster(cluster.name, Node(n.ranks_per_node, n.memory_bytes, 0), device, links, codecs)


def two_nodes(
    cluster: Cluster, rate_bits: float, per_node: int, cores: float, burst_bytes: float
) -> Cluster:
    """The cluster as benchmarks/two_nodes.sh makes it on one machine: nodes of `per_node`
    ranks that share `cores` of the machine's (what a node's ranks got in the sitting; the
    rates of `cluster` are a core's), the link between them a token bucket of `burst_bytes`
    at `rate_bits` per second each way (alpha 100 us, every flow out of a node sharing it)."""
    node = replace(cluster.node, ranks_per_node=per_node, cores=cores)
    network = Link(1e-4, rate_bits / 8, rate_bits / 8, burst_bytes)
    return replace(cluster, node=node, links={**cluster.links, "network": network})


def user_dir() -> Path:
    """Where calibrate writes this machine's file and a name looks first:
    $XDG_CONFIG_HOME/mpihybrid/clusters (~/.config/mpihybrid/clusters)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mpihybrid" / "clusters"


def package_dir() -> Path:
    """The cluster files installed with the package (the repository's clusters/)."""
    return Path(__file__).resolve().parent.parent / "clusters"


def known_clusters() -> list[str]:
    """Every name find_cluster knows: the user's files and the package's."""
    return sorted({p.stem for d in (user_dir(), package_dir()) for p in d.glob("*.toml")})


def find_cluster(name: str | Path) -> Path:
    """The file of a cluster given by path (it has a "/" or ends in .toml) or by name (the
    user's file first, then the package's); ClusterError when there is none."""
    text = str(name)
    if "/" in text or text.endswith(".toml"):
        return Path(text)
    for d in (user_dir(), package_dir()):
        if (d / f"{text}.toml").is_file():
            return d / f"{text}.toml"
    raise ClusterError(
        f"unknown cluster {text!r}: give a file or one of {', '.join(known_clusters())}"
    )


def load_cluster(path: str | Path) -> Cluster:
    """The cluster of a file, or of a name (find_cluster)."""
    p = find_cluster(path)
    if not p.exists():
        raise ClusterError(f"cluster file {str(p)!r} does not exist")
    try:  # a FIFO or a device: refused before it is opened
        data = tomllib.loads(read_text(p, what="cluster file", limit=MAX_TOML_BYTES))
    except InputFileError as exc:
        raise ClusterError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
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
            if key == "burst_bytes" and not value:
                continue  # a NIC's: written only for a shaped link
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


def write_cluster(
    path: str | Path, cluster: Cluster, header: str, notes: dict, overwrite: bool = False
) -> None:
    """Write the cluster file (atomically); an existing file only with `overwrite`."""
    text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text + cluster_toml(cluster, notes), overwrite=overwrite)
