"""What predict says of benchmarks/two_nodes_sitting.sh's pairs: the "predicted" column of
docs/communication.md's "Across nodes" table.

    python benchmarks/two_nodes_predict.py [--cluster local] [--cores JOB=CORES ...]

The harness as a cluster (predict.cluster.two_nodes): nodes of the sitting's ranks (2, or 1 for
A:1,B:1); the cores a node's two ranks got in the sitting (--cores, per job file: its measured
throughput with the link out of the way over what predict says with one core a node; a node of
one rank gets half, a rank's share); the network link at the sitting's RATE each way (alpha
100 us), a token bucket of two_nodes.sh's BURST (256 KiB) that a pipeline message after an idle
link passes at once; everything else from the cluster file. Each line: the pair, the two
predicted throughputs and their ratio (this / that, as `bench train --against` prints it).
The defaults are last sitting's (docs/communication.md): gpt_wire 9,311 tokens/s at 20 Gbit/s,
gpt_bench pp=2 x dp=2 data-inner 1,303 at 500 Mbit/s (where its link is 2 % of the step).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.predict.cluster import find_cluster, load_cluster, two_nodes  # noqa: E402
from mpihybrid.predict.model import predict  # noqa: E402

GPT = ["jobs/gpt_bench.toml", "train.global_batch=16"]
WIRE = ["jobs/gpt_wire.toml"]
RATES = {"2gbit": 2e9, "500mbit": 5e8, "200mbit": 2e8, "100mbit": 1e8, "50mbit": 5e7}
# (rate, ranks a node, job + its --set, this, that): the sitting's pairs
PAIRS = [
    *((r, 2, WIRE, [f"comm.p2p_codec={c}"], ["comm.p2p_codec=fp32"])
      for r in ("2gbit", "500mbit", "200mbit", "100mbit", "50mbit") for c in ("bf16", "int8")),
    *((r, 2, WIRE, ["comm.p2p_codec=int8"], ["comm.p2p_codec=bf16"])
      for r in ("100mbit", "50mbit")),
    ("500mbit", 2, [*GPT, "grid.pp=2", "grid.dp=2", "grid.order=data-inner"],
     ["comm.p2p_codec=int8"], ["comm.p2p_codec=fp32"]),
    *((r, 2, [*GPT, "grid.pp=1", "grid.dp=4", *codec], ["comm.ring=hierarchical"],
       ["comm.ring=flat"])
      for r, codec in (("500mbit", []), ("2gbit", []), ("500mbit", ["comm.codec=int8"]),
                       ("100mbit", []), ("50mbit", []))),
    ("500mbit", 2, [*GPT, "grid.pp=2", "grid.dp=2"], ["grid.order=auto"],
     ["grid.order=data-inner"]),
    ("500mbit", 2, [*GPT, "grid.pp=2", "grid.dp=2"], ["grid.order=pipeline-inner"],
     ["grid.order=data-inner"]),
    ("2gbit", 1, ["jobs/gpt_bench.toml", "grid.pp=1", "grid.dp=2"], ["comm.codec=int8"],
     ["comm.codec=fp32"]),
]  # fmt: skip


BURST = 256 * 1024  # two_nodes.sh's BURST, 256kb (tc: kilobytes)
CORES = {"jobs/gpt_wire.toml": 0.65, "jobs/gpt_bench.toml": 0.51}  # last sitting's


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--cores", action="append", default=[], metavar="JOB=CORES",
                    help="what a node's two ranks got in the sitting, per job")  # fmt: skip
    args = ap.parse_args()
    cores = dict(CORES)
    for item in args.cores:
        job, _, value = item.partition("=")
        cores[job] = float(value)
    base = load_cluster(find_cluster(args.cluster))
    for rate, per_node, job, this, that in PAIRS:
        share = cores[job[0]] / (2 if per_node == 1 else 1)
        on = two_nodes(base, RATES[rate], per_node, share, BURST)
        path, sets = job[0], job[1:]
        world = 2 * per_node
        a = predict(load_job(path, [*sets, *this], world), on)
        b = predict(load_job(path, [*sets, *that], world), on)
        print(
            f"{rate:>8} {per_node} a node  {path} {' '.join(sets)}  {' '.join(this)} / "
            f"{' '.join(that)}: {a['throughput']:,.0f} / {b['throughput']:,.0f} = "
            f"{a['throughput'] / b['throughput']:.3f}"
        )


if __name__ == "__main__":
    main()
