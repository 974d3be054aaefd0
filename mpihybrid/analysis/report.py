"""`mpihybrid analyze` as text: the tables of an analysis() result."""

from __future__ import annotations

from mpihybrid.analysis.cause import why_lines, why_summary
from mpihybrid.analysis.metrics import SPLIT, STEPS_ONLY
from mpihybrid.analysis.oversubscription import oversubscription_text
from mpihybrid.analysis.plain import plain_lines
from mpihybrid.units import human_bytes, human_rate, table


def format_analysis(result: dict) -> str:
    """analyze()'s result as text tables (times per step of the measured window, in ms unless
    marked)."""
    n = max(result["window"]["steps"], 1)

    def ms(seconds: float) -> str:  # per step
        return f"{1e3 * seconds / n:.2f}"

    if result.get("events") == STEPS_ONLY:
        return "\n".join(_steps_only_lines(result, ms))
    lines = _summary_lines(result, ms)
    lines += _time_tables(result, ms)
    lines += _bytes_lines(result)
    rows = [
        [
            str(s["stage"]),
            str(s["peak_inflight"]),
            str(s["predicted_peak_inflight"]),
            human_bytes(s["peak_activation_bytes"]),
        ]
        for s in result["stages"]
    ]
    lines += ["", "activations in flight per stage (peak over steps and replicas)"]
    lines += table(["stage", "peak", "schedule", "peak bytes"], rows)
    if "why" in result:
        lines += why_lines(result["why"])
    return "\n".join(lines)


def _run_line(run: dict) -> str:
    v = f", v={run['virtual_stages']}" if run["virtual_stages"] > 1 else ""
    v += ", gradients sent before W" if run.get("early_grad_send") else ""
    v += f", W merged in {run['merge_w']}s" if run.get("merge_w", 1) > 1 else ""
    wire = ""
    if run.get("p2p_codec", "fp32") != "fp32":
        wire = f", pipeline wire {run['p2p_codec']} ({run.get('p2p_scope', 'inter-node')} links)"
    return (
        f"== {run['schedule']}{v}, pp={run['pp']} x dp={run['dp']}, M={run['microbatches']}, "
        f"codec {run['codec']}{wire}, {run['steps']} step{'s' * (run['steps'] != 1)} traced "
        f"on {run['world_size']} ranks"
    )


def window_text(window: dict) -> str:
    """ "steps 2-60 (59 steps; step 1, warm-up, left out)": the measured window, counted from 1."""
    span = (
        f"step {window['first']}"
        if window["first"] == window["last"]
        else f"steps {window['first']}-{window['last']}"
    )
    span += f" ({window['steps']} step{'s' * (window['steps'] != 1)}"
    left = window["left_out"]
    if left:
        named = f"step {left[0]}" if len(left) == 1 else f"steps {left[0]}-{left[-1]}"
        span += f"; {named}, warm-up, left out"
    return span + ")"


def _state_line(run: dict) -> list[str]:
    """A line saying the run did not finish, when it did not (preempted, stopped or running);
    a line saying it was oversubscribed, when it was."""
    over = oversubscription_text(run.get("oversubscribed"))
    caveat = [f"caveat          {over}"] if over else []
    if run.get("finished", True):
        return caveat
    stopped = run.get("stopped_at_step")
    if stopped is not None:
        return [
            f"state           stopped after step {stopped} (preempted or stopped); traced so far",
            *caveat,
        ]
    return [
        "state           not finished: the run is going on or died; its last flush is here",
        *caveat,
    ]


def throughput_text(tp: dict) -> str | None:
    """ "4,559 samples/s" or, for token data, "291,776 tokens/s (4,559 samples/s)"."""
    if tp["samples_per_s"] is None:
        return None
    if tp.get("tokens_per_s") is not None:
        return f"{tp['tokens_per_s']:,.0f} tokens/s ({tp['samples_per_s']:,.0f} sequences/s)"
    return f"{tp['samples_per_s']:,.0f} samples/s"


def _steps_only_lines(result: dict, ms) -> list[str]:
    """A trace.events = false trace: what it holds and what it cannot show."""
    st, tp, q = result["step_time"], result["throughput"], result["quality"]
    lines = [
        _run_line(result["run"]),
        *_state_line(result["run"]),
        "events          one row per rank and step (trace.events = false): step times only; "
        "no time split, bubble, bytes or activation memory (run with trace.events = true)",
        f"measured        {window_text(result['window'])}: every figure below",
        f"step time       mean {1e3 * st['mean']:.2f} ms, median {1e3 * st['median']:.2f} ms "
        f"(the first traced step took {1e3 * st['first']:.2f} ms)",
    ]
    if throughput_text(tp) is not None:
        lines.append(f"throughput      {throughput_text(tp)}")
    if q["final_loss"] is not None:
        lines.append(
            f"quality         final loss {q['final_loss']:.4f}, "
            f"train accuracy {q['train_accuracy']:.3f}"
        )
    lines += heldout_lines(q["heldout"])
    lines += grad_norm_lines(q.get("grad_norm"))
    lines += ["", "step time by rank (ms per step)"]
    lines += table(["rank", "step ms"], [[str(r["rank"]), ms(r["step"])] for r in result["ranks"]])
    return lines


def grad_norm_lines(norms: dict | None) -> list[str]:
    """train.grad_clip's gradient norms (before clipping), one line."""
    if not norms:
        return []
    return [
        f"gradient norm   last {norms['last']:.4g}, median {norms['median']:.4g}, "
        f"max {norms['max']:.4g} (step {norms['max_step']})"
    ]


def heldout_lines(rows: list[dict]) -> list[str]:
    """The last held-out evaluation, and the first one to compare with."""
    if not rows:
        return []
    last, first = rows[-1], rows[0]
    per_byte = f", {last['bits_per_byte']:.3f} bits/byte" if last["bits_per_byte"] else ""
    since = f" (step {first['step']}: {first['loss']:.4f})" if len(rows) > 1 else ""
    return [
        f"held-out loss   step {last['step']}: {last['loss']:.4f} nats, "
        f"{last['bits_per_token']:.3f} bits/token{per_byte}, perplexity "
        f"{last['perplexity']:.2f}{since}"
    ]


def _summary_lines(result: dict, ms) -> list[str]:
    """The run, step time, throughput, bubble, quality and the busiest rank, a line each (the
    stragglers, scored against their peers, are in the why part: analysis/cause.py)."""
    run, st, bubble = result["run"], result["step_time"], result["bubble"]
    lines = [
        _run_line(run),
        *plain_lines(result),
        *why_summary(result.get("why")),
        *_state_line(run),
        f"measured        {window_text(result['window'])}: every figure below but bytes sent",
        f"step time       mean {1e3 * st['mean']:.2f} ms, median {1e3 * st['median']:.2f} ms "
        f"(the first traced step took {1e3 * st['first']:.2f} ms)",
    ]
    tp = result["throughput"]
    if throughput_text(tp) is not None:
        unit = "sequences" if tp.get("tokens_per_s") is not None else "samples"
        lines.append(
            f"throughput      {throughput_text(tp)}, {tp['samples']:,} {unit} in "
            f"{tp['seconds']:.3f} s of steps"
        )
    lines.append(
        f"bubble          measured {bubble['measured']:.3f}, predicted {bubble['predicted']:.3f} "
        f"(simulated with measured F/B/W and a {1e6 * bubble['costs']['send']:.0f} us hop), "
        f"formula {bubble['formula_text']} = {bubble['formula']:.3f}"
    )
    search = run.get("search")
    if search and search.get("makespan") is not None:
        expected = search.get("expected") or {}
        over = (
            f" ({expected['bubble']:.3f} and {1e3 * expected['makespan']:.1f} ms simulated on "
            f"each of the {expected['steps']} measured steps of "
            f"{expected.get('on', 'a calibration run')})"
            if expected
            else ""
        )
        lines.append(
            f"searched        {search['placement']} placement by {search['found_by']} "
            f"({search['status']}): predicted bubble {search['bubble']:.3f} and pipeline phase "
            f"{1e3 * search['makespan']:.1f} ms from the costs it was searched on{over}; "
            f"measured bubble {bubble['measured']:.3f}"
        )
    q = result["quality"]
    if q["final_loss"] is not None:
        acc = (
            f", held-out accuracy {q['test_accuracy']:.3f}"
            if q["test_accuracy"] is not None
            else ""
        )
        lines.append(
            f"quality         final loss {q['final_loss']:.4f}, "
            f"train accuracy {q['train_accuracy']:.3f}{acc}"
        )
    lines += heldout_lines(q["heldout"])
    lines += grad_norm_lines(q.get("grad_norm"))
    if result["straggler"] is not None:
        s = result["straggler"]
        lines.append(
            f"busiest rank    rank {s['rank']}: busy {ms(s['busy'])} ms/step "
            f"(F+B+W+optimizer), {s['vs_mean']:.2f}x the mean rank"
        )
    return lines


def _time_tables(result: dict, ms) -> list[str]:
    """Time by rank and by stage."""
    run = result["run"]
    # the main thread's columns add up to the step; all-reduce and optimizer run per bucket,
    # behind them when comm.overlap is on, and "grad wait" is the part the step waited for
    cols = ["forward", "backward", "weight", "recv", "send", "exposed_comm", "idle"]
    heads = [f"{h} ms" for h in ("F", "B", "W", "p2p wait", "send", "grad wait", "idle")]
    rows = [
        [str(r["rank"]), ",".join(map(str, r["stages"])), str(r["replica"])]
        + [ms(r[c]) for c in cols]
        + [ms(r["total"]), f"{r['bubble']:.3f}" if r["bubble"] is not None else "-"]
        + [ms(r["allreduce"]), ms(r["optimizer"]), f"{100 * r['hidden_fraction']:.0f}%"]
        for r in result["ranks"]
    ]
    lines = [
        "",
        "time by rank (ms per step; F..idle add up to the step; grad wait = the step waiting for "
        "its gradient buckets after the pipeline; all-reduce and optim run per bucket, hidden "
        "= their share behind the compute)",
        "  p2p wait = blocked in a receive of activations or gradients from a neighbour stage;"
        " idle = what no event covers (the loop between actions, the step's metrics)",
    ]
    lines += table(
        ["rank", "stage", "dp", *heads, "step ms", "bubble", "all-reduce ms", "optim ms", "hidden"],
        rows,
    )
    heads = [f"{h} ms" for h in ("F", "B", "W", "p2p wait", "send", "allreduce", "optim")]

    replicas = max(run["dp"], 1)
    rows = [
        [str(s["stage"])]
        + [f"{1e6 * s['mean_' + c]:.0f}" for c in ("forward", "backward", "weight")]
        + [ms(s[c] / replicas) for c in SPLIT]
        for s in result["stages"]
    ]
    lines += ["", "time by stage (one F/B/W in us; totals in ms per step, mean over replicas)"]
    lines += table(["stage", "F us", "B us", "W us", *heads], rows)
    return lines


def _bytes_lines(result: dict) -> list[str]:
    """Bytes sent by kind, and the all-reduce bandwidth per stage."""
    b = result["bytes"]
    lines = [
        "",
        f"bytes sent      activation {human_bytes(b['activation'])}, activation_grad "
        f"{human_bytes(b['activation_grad'])}, all-reduce {human_bytes(b['allreduce'])} "
        f"(every traced step: {result['window']['traced_steps']})",
    ]
    if result["allreduce"]:
        rows = [
            [
                str(a["stage"]),
                a.get("phase", "all-reduce"),
                str(a["ranks"]),
                human_bytes(a["size_bytes"]) if a["size_bytes"] is not None else "-",
                f"{1e6 * a['seconds']:.0f}",
                human_rate(a["algbw"]),
                human_rate(a["busbw"]),
                human_bytes(a["wire_bytes"]),
            ]
            for a in result["allreduce"]
        ]
        lines += [
            "",
            "all-reduce per stage (size = the fp32 vector; busbw = algbw * 2(n-1)/n, "
            "a reduce-scatter's or all-gather's algbw * (n-1)/n)",
        ]
        heads = ["stage", "phase", "n", "size", "time us", "algbw", "busbw", "wire/rank"]
        lines += table(heads, rows)
    return lines
