"""What `mpihybrid schedule search` prints of a search's result (search.search): what was found
and by what, its proof, the grid, the bounds, the built-ins on the same costs.

    print(format_result(search(costs, pp=2, m=4)))
"""

from __future__ import annotations

from mpihybrid.pipeline.search import TIE_MARGIN, SearchResult, _time
from mpihybrid.units import table


def format_result(result: SearchResult, grid: bool = True) -> str:
    """What `mpihybrid schedule search` prints."""
    from mpihybrid.pipeline.simulate import render_grid

    best, unit = result.best, result.costs.source == "unit"
    pl = best.placement
    where = " ".join(f"r{r}:{','.join(map(str, pl.stages_of(r)))}" for r in range(pl.pp))
    how = {"exact": "the exact search (CP-SAT)", "greedy": "the greedy list scheduler"}.get(
        best.how,
        f"the built-in {best.how}'s order and split"
        + (f" (nothing found beat its step by {TIE_MARGIN:.0%})" if best.merged == 1 else ""),
    )
    if best.merged > 1:
        how += f", its W passes merged in groups of {best.merged}"
    # proved under the simulator's timing, the optimizer's tail aside (the exact model has none)
    proof = {
        "optimal": "optimal: proved"
        + (" (as simulated, the optimizer's updates aside)" if any(result.costs.tail) else ""),
        "feasible": f"best found, proven gap {result.gap:.1%}",
        "heuristic": "no proven bound",
    }.get(result.status, result.status)
    lines = [
        f"schedule search: pp={result.pp} M={result.m}, costs: {result.costs.source}; at most "
        f"{result.max_inflight:g} micro-batches of a rank's share alive per rank"
        + (" (all of them: no limit)" if result.max_inflight >= result.m else ""),
        f"found: {pl.style} placement ({where}), {[len(r) for r in best.ranges]} "
        f"{'(the trace' + chr(39) + 's stages)' if result.costs.fixed else 'blocks per stage'}, "
        f"by {how}; {proof}",
    ]
    if grid:
        lines.append(render_grid(best.lists, pl, 8, 64))
    sim = best.sim
    lines += [
        f"simulated: step {_time(sim.makespan, unit)}, bubble {sim.bubble_fraction:.3f}, peak "
        f"per rank {', '.join(f'{p:g}' for p in sim.peak_per_rank)} micro-batches of its share",
        f"step-time bound (the busiest rank's own work at this split): "
        f"{_time(result.step_bound, unit)} ({sim.makespan / result.step_bound - 1:+.1%} from it)",
        f"with the pipe's fill (no rank's work starts before its first input can arrive), no "
        f"order at this split beats {_time(result.fill_bound, unit)} "
        f"({sim.makespan / result.fill_bound - 1:+.1%} from it)",
    ]
    anywhere = result.any_bound
    if anywhere is not None:
        lines.append(
            f"no schedule of these whole blocks on {result.pp} ranks beats "
            f"{_time(anywhere, unit)} ({sim.makespan / anywhere - 1:+.1%} from it), "
            "whatever its placement, split, order or memory"
        )
    for style, status, seconds, work, found, bound in result.solver_seconds:
        lines.append(
            f"solver, {style}: {status} in {seconds:.2f} s, {work:.2f} deterministic (model step "
            f"{_time(found, unit)}, proven bound {_time(bound, unit)})"
        )
    lines += result.notes
    lines.append(
        "built-in schedules on the same costs (each at the split that balances its "
        "placement, as model.partition = 'timed'; gradients sent before W):"
    )
    rows = []
    for row in result.table:
        if "makespan" not in row:
            rows.append([row["schedule"], row["v"], *[""] * 5, f"not legal: {row['note']}"])
            continue
        bound = f"{row['vs_bound']:+.1%}" if row["vs_bound"] is not None else "-"
        rows.append([row["schedule"], row["v"], _time(row["makespan"], unit),
                     f"{row['bubble']:.3f}", f"{row['peak']:g}", f"{row['vs_best']:+.1%}", bound,
                     row["note"]])  # fmt: skip
    header = ["schedule", "v", "step", "bubble", "rank peak", "vs best", "vs bound", "note"]
    lines += table(header, rows, left=(7,))
    return "\n".join(lines)
