"""Projection of jobs/a100_gpt.toml from 1 x 8 to 128 x 8 A100 with `mpihybrid predict`:
for every node count, the best predicted layout (pp, dp, placement, schedule, M, codec) that
fits in the GPU's memory, under weak scaling (8 sequences per GPU) and strong scaling (a fixed
global batch of 1024 sequences); and which schedule and codec win.

    python benchmarks/predict_a100.py                                   # the table
    python benchmarks/predict_a100.py --plot runs/a100_projection.png   # and the plot (plot extra)
    python benchmarks/predict_a100.py --cluster clusters/a100_40gb.toml

Predictions, not measurements: the cluster file's figures (peaks, nccl-tests) and the cost
model of mpihybrid.predict; the runtime as it is (fp32 GEMMs, the ring on host copies).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mpihybrid.config import ConfigError, build_job, load_table, resolve
from mpihybrid.pipeline.schedules import ScheduleError
from mpihybrid.predict.cluster import load_cluster
from mpihybrid.predict.model import predict

ROOT = Path(__file__).resolve().parent.parent
NODES = (1, 2, 4, 8, 16, 32, 64, 128)
PIPELINES = (1, 2, 4, 8)
SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("gpipe", 1))
MICROBATCHES = (4, 8, 16, 32)
CODECS = ("fp32", "bf16", "int8")
ORDERS = ("data-inner", "pipeline-inner")


def candidates(world: int, global_batch: int):
    """Every layout of `world` ranks the job accepts for this global batch."""
    for pp in PIPELINES:
        dp = world // pp
        for m in MICROBATCHES:
            if global_batch % (dp * m):
                continue
            for (schedule, v), codec, order in (
                (s, c, o) for s in SCHEDULES for c in CODECS for o in ORDERS
            ):
                yield [f"grid.pp={pp}", f"grid.dp={dp}", f"grid.order={order}",
                       f"train.schedule={schedule}", f"train.virtual_stages={v}",
                       f"train.microbatches={m}", f"train.global_batch={global_batch}",
                       f"comm.codec={codec}"]  # fmt: skip


def best(job_file: str, cluster, world: int, global_batch: int) -> tuple[dict, dict] | None:
    """(the fastest prediction that fits, the fastest per (schedule, codec)) for one size."""
    table = load_table(job_file)
    top, per_choice = None, {}
    for sets in candidates(world, global_batch):
        try:
            job = resolve(build_job(table, sets), world)
        except (ConfigError, ScheduleError, ValueError):
            continue  # e.g. interleaving needs M % pp == 0
        r = predict(job, cluster)
        if r["peak_memory_bytes"] > cluster.node.memory_bytes:
            continue
        r["sets"] = sets
        key = (job.train.schedule, job.comm.codec)
        if key not in per_choice or r["step_time_s"] < per_choice[key]["step_time_s"]:
            per_choice[key] = r
        if top is None or r["step_time_s"] < top["step_time_s"]:
            top = r
    return (top, per_choice) if top else None


def _row(mode: str, nodes: int, r: dict, per_choice: dict) -> str:
    j = r["job"]
    schedule = j["schedule"] + (f" v={j['virtual_stages']}" if j["virtual_stages"] > 1 else "")
    fp32 = per_choice.get((j["schedule"], "fp32"))
    vs_fp32 = f"{fp32['step_time_s'] / r['step_time_s']:.2f}x" if fp32 else "-"
    return (
        f"| {mode} | {nodes} x 8 | {j['global_batch']} | {j['pp']} x {j['dp']} {j['order']} | "
        f"{schedule} | {j['microbatches']} | {j['codec']} | {r['step_time_s']:.3f} | "
        f"{r['throughput']:,.0f} | {100 * r['efficiency']:.0f}% | {r['bubble']:.3f} | "
        f"{r['exposed_comm_s']:.3f} | {r['peak_memory_bytes'] / 1e9:.1f} | {vs_fp32} |"
    )


def project(job_file: str, cluster_file: str) -> list[dict]:
    cluster = load_cluster(cluster_file)
    rows = []
    for mode in ("weak", "strong"):
        for nodes in NODES:
            world = 8 * nodes
            global_batch = 8 * world if mode == "weak" else 1024
            found = best(job_file, cluster, world, global_batch)
            if found:
                rows.append({"mode": mode, "nodes": nodes, "best": found[0], "choices": found[1]})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| scaling | GPUs | batch | pp x dp, placement | schedule | M | codec | step s | "
        "tokens/s | efficiency | bubble | exposed comm s | peak GB | fp32 ring: slower by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(r["mode"], r["nodes"], r["best"], r["choices"]) for r in rows]
    return "\n".join(lines)


def format_choices(rows: list[dict]) -> str:
    """Per size: the best step time of each schedule (any codec) and each codec (any schedule),
    relative to the winner."""
    names = [s for s, _ in SCHEDULES]
    lines = [
        "| scaling | GPUs | " + " | ".join(names) + " | " + " | ".join(CODECS) + " |",
        "|---|---|" + "---|" * (len(names) + len(CODECS)),
    ]
    for r in rows:
        top = r["best"]["step_time_s"]

        def rel(keys, choices=r["choices"], top=top) -> str:
            found = [choices[k]["step_time_s"] for k in keys if k in choices]
            return f"{min(found) / top:.2f}" if found else "-"

        cells = [rel([(s, c) for c in CODECS]) for s in names]
        cells += [rel([(s, c) for s in names]) for c in CODECS]
        lines.append(f"| {r['mode']} | {8 * r['nodes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the worst step-time error of the validation on the development machine (docs/predict.md);
# the A100 figures themselves are not validated: a band of this width is the least to expect
VALIDATED_ERROR = 0.184


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    kinds = {(r["best"]["job"]["schedule"], r["best"]["job"]["virtual_stages"],
              r["best"]["job"]["codec"]) for r in rows}  # fmt: skip
    same = len(kinds) == 1
    for mode, marker, colour in (("weak", "o", "C0"), ("strong", "s", "C1")):
        mine = [r for r in rows if r["mode"] == mode]
        gpus = [8 * r["nodes"] for r in mine]
        step = [r["best"]["step_time_s"] for r in mine]
        eff = [100 * r["best"]["efficiency"] for r in mine]
        mem = [r["best"]["peak_memory_bytes"] / 1e9 for r in mine]
        for ax, ys in zip(axes, (step, eff, mem), strict=True):
            ax.plot(gpus, ys, marker=marker, color=colour, label=f"{mode} scaling")
        axes[0].fill_between(
            gpus, [y * (1 - VALIDATED_ERROR) for y in step],
            [y * (1 + VALIDATED_ERROR) for y in step], color=colour, alpha=0.15, lw=0,
        )  # fmt: skip
        # each point's layout, pp x dp, above the strong line and below the weak one
        below = mode == "weak"
        for g, y, r in zip(gpus, step, mine, strict=True):
            j = r["best"]["job"]
            label = f"{j['pp']}x{j['dp']}"
            if not same:
                label += f" {j['schedule']} {j['codec']}"
            axes[0].annotate(label, (g, y), fontsize=7, ha="center",
                             va="top" if below else "bottom", textcoords="offset points",
                             xytext=(0, -9 if below else 7))  # fmt: skip
    band = plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.25)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(
        [*handles, band],
        [*labels, f"+-{100 * VALIDATED_ERROR:.0f}%: the worst error validated (on CPUs)"],
        fontsize=8, loc="upper right",
    )  # fmt: skip
    axes[0].set_title("predicted step time (s); labels: pp x dp")
    axes[0].set_yscale("log")
    axes[0].margins(x=0.08, y=0.15)
    axes[1].set_title("efficiency (% of the achieved SGEMM rate)")
    axes[1].legend(fontsize=8)
    axes[2].axhline(80, color="grey", linestyle="--", linewidth=1, label="A100 80 GB")
    axes[2].set_title("peak memory per GPU (GB)")
    axes[2].set_ylim(0, 90)
    axes[2].legend(fontsize=8, loc="center right")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("A100 GPUs (8 per node)")
        ax.grid(alpha=0.3)
    layouts = ""
    if same:
        name, v, codec = next(iter(kinds))
        order = {r["best"]["job"]["order"] for r in rows}
        layouts = (
            f"; every best layout: {name}" + (f" (v={v} chunks per rank)" if v > 1 else "")
            + f", {codec} gradients, placement " + " or ".join(sorted(order))
        )  # fmt: skip
    fig.suptitle(
        "jobs/a100_gpt.toml (780 M GPT) predicted on clusters/a100_80gb.toml, the fastest layout "
        "that fits per size (weak: 8 sequences per GPU; strong: 1024 sequences a step)"
        + layouts, fontsize=10, wrap=True,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=str(ROOT / "jobs/a100_gpt.toml"))
    parser.add_argument("--cluster", default=str(ROOT / "clusters/a100_80gb.toml"))
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args()
    rows = project(args.job, args.cluster)
    print(format_rows(rows))
    print()
    print("best step time of each schedule and each codec / the best of all (1.00 = wins):")
    print(format_choices(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
