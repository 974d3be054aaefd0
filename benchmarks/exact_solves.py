"""The exact search's solves on a job's timed costs, deterministically as train.schedule = "auto"
runs them: per solve its status, wall and deterministic seconds, model step and proven bound,
then the step found against the fastest built-in (docs/vocab.md, "The search with the passes").

    python benchmarks/exact_solves.py jobs/gpt_bench_vocab.toml --costs /tmp/vocab2.json
    python benchmarks/exact_solves.py jobs/gpt_bench_head.toml --set grid.pp=4 \
        --set model.vocab_parallel=true --set model.depth=6 --set train.microbatches=8 \
        --costs /tmp/head4.json --limit 4 --gap 0

--costs: the timed costs are saved there the first time and read back after, so two checkouts
solve the same costs (the blocks timed again differ by more than the solves do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from mpihybrid.config import load_job
from mpihybrid.config.searched import AUTO_GAP, auto_placements
from mpihybrid.pipeline.search import search
from mpihybrid.pipeline.search_costs import SearchCosts, job_costs


def costs_for(job, path: str | None) -> SearchCosts:
    if path and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        return SearchCosts(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    costs = job_costs(job)
    if path:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(costs), f)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--costs", default=None, help="JSON file to save the costs to or read")
    parser.add_argument("--limit", type=float, default=None, help="default: train.schedule_time")
    parser.add_argument("--gap", type=float, default=AUTO_GAP)
    args = parser.parse_args()
    pp = next((int(s.split("=")[1]) for s in reversed(args.sets) if s.startswith("grid.pp=")), 2)
    job = load_job(args.job, args.sets, pp)
    t = job.train
    limit = t.schedule_time if args.limit is None else args.limit
    result = search(costs_for(job, args.costs), pp, t.microbatches,
                    max_inflight=t.schedule_inflight or None, placements=auto_placements(t),
                    time_limit=limit, deterministic=True, gap_limit=args.gap)  # fmt: skip
    work = 0.0
    for style, status, seconds, det, found, bound in result.solver_seconds:
        work += det
        print(
            f"{style:16s} {status:9s} {seconds:6.2f} s {det:5.2f} det  model step "
            f"{found * 1e3:9.3f} ms  bound {bound * 1e3:9.3f} ms"
        )
    builtin = min((r for r in result.table if "makespan" in r), key=lambda r: r["makespan"])
    searched = result.searched
    print(f"deterministic time {work:.2f} of {limit:g} over {len(result.solver_seconds)} solves")
    print(
        f"searched: {searched.how} {searched.placement.style} "
        f"{[len(r) for r in searched.ranges]} {searched.sim.makespan * 1e3:.3f} ms; fastest "
        f"built-in {builtin['schedule']} {builtin['makespan'] * 1e3:.3f} ms; kept: "
        f"{result.best.how} {result.best.sim.makespan * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
