"""`mpihybrid whatif`: a trace's measured costs replayed through the simulator under a change.

mpihybrid whatif runs/1f1b.h5 --set schedule=zb-h1 --set microbatches=8
mpihybrid whatif runs/1f1b.h5 --scale stage1.F=0.5 --scale hop=4 [--json]
"""

from __future__ import annotations

import math

import click

from mpihybrid.cli.trace import _fail, _load

KEYS = {
    "schedule": "schedule",
    "microbatches": "microbatches",
    "m": "microbatches",
    "virtual_stages": "virtual_stages",
    "v": "virtual_stages",
    "partition": "partition",
    "split": "partition",
    "link": "link",
    "merge_w": "merge_w",
}
LINKS = ("duplex", "shared")
KIND_NAMES = ("F", "B", "W")


def parse_set(items: tuple[str, ...]) -> dict:
    """--set KEY=VALUE pairs (schedule, microbatches or M) as Change fields."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        field = KEYS.get(key.strip().lower())
        if not sep or field is None:
            _fail(f"--set {item}: the keys are schedule, microbatches (M), virtual_stages (v), "
                  "partition (split), link, merge_w")  # fmt: skip
        if field in ("microbatches", "virtual_stages", "merge_w"):
            try:
                m = int(value)
            except ValueError:
                m = 0
            if m < 1 or m > 1 << 16:
                _fail(f"--set {item}: {key} must be a whole number from 1 to 65536")
            out[field] = m
        elif field == "partition":
            counts = value.replace(",", " ").split()
            if not counts or not all(c.isdigit() for c in counts):
                _fail(f"--set {item}: the layers of each stage, e.g. partition=3,1")
            out[field] = tuple(int(c) for c in counts)
        elif field == "link":
            if value.strip() not in LINKS:
                _fail(f"--set {item}: link is duplex (a link each way) or shared (one wire)")
            out[field] = value.strip()
        else:
            out[field] = value.strip()
    return out


def parse_scale(items: tuple[str, ...]) -> dict:
    """--scale WHAT=FACTOR: WHAT is hop, gap (a rank's time between actions), tail (the
    optimizer's update in a stage's last W), F/B/W, stageN[.F], rankN[.B]; FACTOR finite >= 0."""
    out: dict = {}
    for item in items:
        what, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not sep or not math.isfinite(factor) or factor < 0 or factor > 1e6:
            _fail(f"--scale {item}: the factor must be a number from 0 to 1e6")
        key = _scale_key(what.strip(), item)
        out[key] = out.get(key, 1.0) * factor
    return out


def _scale_key(what: str, item: str):
    if what in ("hop", "gap", "tail"):
        return what
    head, _, kind = what.partition(".")
    if head in KIND_NAMES and not kind:
        return ("all", -1, head)
    kind = kind or "*"
    for where in ("stage", "rank"):
        if head.startswith(where) and head[len(where) :].isdigit() and kind in (*KIND_NAMES, "*"):
            return (where, int(head[len(where) :]), kind)
    _fail(f"--scale {item}: WHAT is hop, gap, tail, F, B, W, stageN, rankN, stageN.F, ...")


@click.command()
@click.argument("run", metavar="RUN.h5")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="schedule=NAME|csv:PATH|auto, microbatches=M, virtual_stages=V, "
                   "partition=3,1 (layers per stage), link=duplex|shared (messages queue on "
                   "their link), merge_w=4 (W passes merged, costed by the row probe) "
                   "(repeatable).")  # fmt: skip
@click.option("--scale", "scales", multiple=True, metavar="WHAT=FACTOR",
              help="hop=2, F=0.5, stage1.B=0.8, rank3=1.3 ... (repeatable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead.")
def whatif(run, sets, scales, as_json) -> None:
    """Replay RUN.h5's measured costs through the schedule simulator under a change: the
    predicted step, throughput and bubble against the measured ones, and the gain ceiling
    (the step with each stage's F, B, W or the hop halved and zero). docs/analysis.md."""
    import json

    from mpihybrid.analysis.replay import (
        Change,
        Measured,
        ReplayError,
        gain_table,
        mean_of,
        measured_figures,
        replay,
    )
    from mpihybrid.pipeline.schedules import ScheduleError
    from mpihybrid.predict.rows import costed

    change = Change(**parse_set(sets), scales=parse_scale(scales))
    trace = _load(run)
    try:
        base = Measured.of(trace, run)
        _check_targets(base, change)
        change = costed(base, change)  # a change of M: the trace's row probe, or the model
        own = replay(base, Change(link=change.link))
        asked = replay(base, change)
        gains = gain_table(base)
    except (ReplayError, ScheduleError) as exc:
        _fail(str(exc))
    hop = mean_of(base).send  # the steps' and replicas' mean hop, as the search reads it
    notes = []
    if hop == 0 and (change.link or "hop" in change.scales):
        notes.append(
            "the trace's hop reads 0: no message found its receiver already waiting, so the hop "
            "itself was not measured, and a change of the hop or the link has nothing to scale"
        )
    if change.merge_w and change.merge_w > 1 and change.merge_ratios is None:
        notes.append(
            "the trace has no row probe (train.row_probe): a merged W is costed as the W passes "
            "it merges, so merge_w moves only the order and the memory"
        )
    doc = {
        "run": run,
        "change": change.text(),
        "hop": hop,
        "merge_ratios": change.merge_ratios,
        "notes": notes,
        "measured": measured_figures(base) | {"bubble": None},
        "replayed": own,
        "predicted": asked,
        "gain_ceiling": gains,
        "steps": len(base.steps),
    }
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo("\n".join(whatif_lines(doc)))


def _check_targets(base, change) -> None:
    from mpihybrid.analysis.replay import ReplayError

    stages, ranks = base.pp * base.v, base.pp * base.dp
    for key in change.scales:
        if isinstance(key, str) or key[0] == "all":
            continue
        where, i, _ = key
        limit = stages if where == "stage" else ranks
        if i >= limit:
            raise ReplayError(f"--scale {where}{i}: the trace has {limit} {where}s")


def whatif_lines(doc: dict) -> list[str]:
    from mpihybrid.units import table

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.2f} ms"

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f} samples/s"

    m, own, new = doc["measured"], doc["replayed"], doc["predicted"]
    err = (own["step"] - m["step"]) / m["step"] if m["step"] else 0.0
    lines = [
        f"{doc['run']}: {doc['steps']} measured steps replayed through the simulator",
        f"change          {doc['change']}",
        f"in short        the step would take {ms(new['step'])} against {ms(m['step'])} measured "
        f"({new['step'] / m['step'] - 1:+.1%}); replaying the run unchanged gives "
        f"{ms(own['step'])} ({err:+.1%}, the replay's own error)",
        *(f"note            {n}" for n in doc.get("notes", [])),
        "",
    ]
    rows = [
        ["step", ms(m["step"]), ms(own["step"]), ms(new["step"])],
        ["pipeline phase", ms(m["phase"]), ms(own["phase"]), ms(new["phase"])],
        ["throughput", rate(m["throughput"]), rate(own["throughput"]), rate(new["throughput"])],
        ["bubble", "-", f"{own['bubble']:.3f}", f"{new['bubble']:.3f}"],
    ]
    lines += table(["", "measured", "replayed as run", "predicted"], rows)
    lines += ["", "gain ceiling (the run as it ran, one cost changed; the largest gain first)"]
    gains = [
        [g["what"], ms(g["half"]), f"{g['half'] / g['now'] - 1:+.1%}", ms(g["zero"]),
         f"{g['zero'] / g['now'] - 1:+.1%}"]
        for g in doc["gain_ceiling"]
    ]  # fmt: skip
    lines += table(["cost", "halved", "step", "zero", "step"], gains)
    return lines
