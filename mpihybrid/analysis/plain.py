"""What analyze's figures mean for this run, in plain words: the first lines a reader sees.

    plain_lines(analyze(trace))
    # in short        bubble 0.21 measured vs 0.20 for 1f1b at pp=2, M=4: the stages idle about
    #                 a fifth of each step waiting on each other
    #                 near the formula: a forward takes 3.10 ms per micro-batch and a message
    #                 0.05 ms, so the schedule, not the messages, sets the idle time

The second line says which of these holds: more ranks than cores (the bubble then measures the
machine), message latency comparable to the work (it then sets the bubble, not the schedule),
near the formula, or away from it (the simulation with the run's own costs says by how much).
"""

from __future__ import annotations

# a hop at least this fraction of a forward: the messages, not the schedule, set the idle time
LATENCY_BOUND = 0.5
# measured within this of the formula (absolute, or relative to it): "near the formula"
NEAR_ABS, NEAR_REL = 0.05, 0.25
_FRACTIONS = (
    (0.0, "none"),
    (0.05, "a twentieth"),
    (0.1, "a tenth"),
    (1 / 8, "an eighth"),
    (1 / 6, "a sixth"),
    (0.2, "a fifth"),
    (0.25, "a quarter"),
    (1 / 3, "a third"),
    (0.4, "two fifths"),
    (0.5, "half"),
    (0.6, "three fifths"),
    (2 / 3, "two thirds"),
    (0.75, "three quarters"),
    (0.8, "four fifths"),
    (0.9, "nine tenths"),
    (1.0, "all"),
)
INDENT = " " * 16


def fraction_words(x: float) -> str:
    """0.21 -> "about a fifth": the nearest simple fraction, in words."""
    value, words = min(_FRACTIONS, key=lambda f: abs(f[0] - x))
    return words if value in (0.0, 1.0) and abs(value - x) < 0.02 else f"about {words}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def plain_lines(result: dict) -> list[str]:
    """Two or three lines: the bubble against the formula, and what sets it in this run."""
    run, bubble = result["run"], result["bubble"]
    if run["pp"] == 1:
        return [
            "in short        one pipeline stage (pp=1): no rank waits on another stage; a step "
            "is its compute and the gradient all-reduce"
        ]
    measured, formula = bubble["measured"], bubble["formula"]
    head = (
        f"in short        bubble {measured:.2f} measured vs {formula:.2f} for {run['schedule']} "
        f"at pp={run['pp']}, M={run['microbatches']}: the stages idle {fraction_words(measured)} "
        "of each step waiting on each other"
    )
    return [head, INDENT + _why(run, bubble)]


def _why(run: dict, bubble: dict) -> str:
    measured, formula, costs = bubble["measured"], bubble["formula"], bubble["costs"]
    forwards = [f for f in costs["forward"] if f > 0] or [0.0]
    forward, hop = sum(forwards) / len(forwards), costs["send"]
    over = run.get("oversubscribed")
    if over:
        return (
            f"oversubscribed: {over['ranks']} ranks on {over['cores']} cores, so ranks also wait "
            "for a core and the bubble measures the machine more than the schedule (a core per "
            f"rank: mpiexec -n {over['cores']} with a job of pp x dp = {over['cores']})"
        )
    work = f"a forward takes {_ms(forward)} per micro-batch and a message {_ms(hop)}"
    if hop >= LATENCY_BOUND * forward:
        return (
            f"latency bound: {work}, so the messages, not the schedule, set the idle time "
            "(larger micro-batches or a larger model would show the formula)"
        )
    if abs(measured - formula) <= max(NEAR_ABS, NEAR_REL * formula):
        return f"near the formula: {work}, so the schedule, not the messages, sets the idle time"
    side = "above" if measured > formula else "below"
    return (
        f"{side} the formula, which takes equal stages, a backward as long as a forward and "
        f"instant messages: {work}; simulated with this run's own costs the bubble is "
        f"{bubble['predicted']:.2f}"
    )
