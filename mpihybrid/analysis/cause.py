"""Why each step is as long as it is: analyze's "why" part (critical path, idle by cause,
stragglers and what fixing them would buy), from critical.py, idle.py, stragglers.py and the
replay.

    doc = why(trace, steps)          # JSON-ready; steps: the measured window, 0-based
    why_lines(doc)                   # the text analyze prints
"""

from __future__ import annotations

from mpihybrid.analysis.critical import critical_paths, path_text, representative, shares
from mpihybrid.analysis.idle import CAUSES, attribute_idle
from mpihybrid.analysis.lanes import Lanes, LanesError
from mpihybrid.analysis.oversubscription import oversubscription
from mpihybrid.analysis.stragglers import straggler_cost, straggler_lines, stragglers
from mpihybrid.units import table


def why(trace, steps: list[int], path: str = "the trace") -> dict:
    """{"critical": {shares, representative, paths}, "idle", "stragglers", "gain", "notes"}."""
    from mpihybrid.analysis.replay import Measured, ReplayError, core_probe, gain_table

    try:
        lanes = Lanes.of(trace.events)
    except LanesError as exc:
        return {"notes": [str(exc)]}
    steps = [s for s in steps if s in set(lanes.step_numbers())]
    pp, dp = int(trace.attrs.get("pp", 1)), int(trace.attrs.get("dp", 1))
    paths = critical_paths(lanes, steps)
    rep = representative(paths)
    doc: dict = {
        "critical": {
            "shares": shares(paths),
            "representative": rep.as_dict() if rep else None,
            "representative_text": path_text(rep) if rep else [],
            "paths": [p.as_dict() for p in paths],
        },
        "idle": attribute_idle(lanes, steps),
        "stragglers": stragglers(trace.events, steps, dp, core_probe(trace.attrs, pp * dp))
        | {"oversubscribed": oversubscription(trace.attrs)},
        "gain": [],
        "notes": [],
    }
    try:
        base = Measured.of(trace, path)
        doc["gain"] = gain_table(base)[:4]
        for named in doc["stragglers"]["named"] + doc["stragglers"]["devices"]:
            named["cost"] = straggler_cost(base, named)
    except ReplayError as exc:
        doc["notes"].append(f"no replay: {exc}")
    return doc


def _share_words(shares_: dict) -> str:
    """ "F s1 41 %, B s1 30 %, ..." the largest first, the small ones folded."""
    shown = [(k, v) for k, v in shares_.items() if v >= 0.01]
    rest = 1.0 - sum(v for _, v in shown)
    words = [f"{k} {100 * v:.0f} %" for k, v in shown]
    if rest >= 0.005:
        words.append(f"other {100 * rest:.0f} %")
    return ", ".join(words)


vocab_words = (
    "; vocab S v1 = vocabulary share 1's logits and statistics, E its embedding part, T the "
    "loss's gradient, G its rows' gradient (model.vocab_parallel)"
)


def why_lines(doc: dict) -> list[str]:
    """The critical path in words, idle by cause per rank, the stragglers, the gain ceiling."""
    if "critical" not in doc:
        return [f"why             {n}" for n in doc.get("notes", [])]
    crit = doc["critical"]
    rep = crit["representative"]
    lines = [
        "",
        "why the step takes what it takes (the critical path across ranks: the chain of "
        "actions, message hops and runtime gaps that set each step's end)",
        f"critical path   {_share_words(crit['shares'])} of the path's time over the measured "
        "steps (F s1 = forwards of stage 1; hop = a message from its send's end to its "
        "receive's end; runtime = the ranks' own time between actions"
        + (vocab_words if any(k.startswith("vocab") for k in crit["shares"]) else "")
        + ")",
    ]
    top = next(iter(crit["shares"]), None)
    if top is not None:
        lines.append(
            f"                the largest link is {top}: making it faster shortens the step"
        )
    lines += _gain_lines(doc.get("gain", []))
    lines += straggler_lines(doc["stragglers"])
    lines += doc.get("notes", [])
    if rep:
        lines += [
            "",
            f"the critical path of step {rep['step']} (the median path, "
            f"{1e3 * rep['seconds']:.2f} ms), in time order:",
        ]
        lines += [f"  {line}" for line in crit["representative_text"]]
    lines += [
        "",
        "idle time by cause (ms per step; adds up to each rank's idle: step - F - B - W"
        " - vocabulary passes)",
    ]
    n = max(doc["idle"]["steps"], 1)
    rows = []
    for r in doc["idle"]["ranks"]:
        waited = next(iter(r["senders"]), "-")
        rows.append(
            [str(r["rank"]), f"{1e3 * r['idle'] / n:.2f}"]
            + [f"{1e3 * r['causes'][c] / n:.2f}" for c in CAUSES]
            + [waited]
        )
    lines += table(["rank", "idle", *CAUSES, "waited most for"], rows, left=(7,))
    return lines


def why_summary(doc: dict | None) -> list[str]:
    """One line for the top of analyze: what the critical path is made of, the largest first,
    and the largest gain the replay finds (the why part at the end says more)."""
    if not doc or "critical" not in doc or not doc["critical"]["shares"]:
        return []
    shares_ = doc["critical"]["shares"]
    top = ", ".join(f"{k} {100 * v:.0f} %" for k, v in list(shares_.items())[:3])
    gain = doc.get("gain") or []
    best = ""
    if gain and gain[0]["half"] < gain[0]["now"]:
        cut = 1 - gain[0]["half"] / gain[0]["now"]
        best = f"; halving {gain[0]['what']} would shorten the step {cut:.0%}"
    return [f"why             the critical path is {top} of its time{best} (why, at the end)"]


def _gain_lines(gain: list[dict]) -> list[str]:
    if not gain:
        return []
    best = gain[0]
    words = ", ".join(f"{g['what']} {g['half'] / g['now'] - 1:+.1%}" for g in gain[:3])
    return [
        f"gain ceiling    halving one cost (replayed): {words}; with {best['what']} at zero the "
        f"step would take {1e3 * best['zero']:.2f} ms ({best['zero'] / best['now'] - 1:+.1%}); "
        "mpihybrid whatif for more"
    ]
