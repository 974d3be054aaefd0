"""Point-to-point messages in a trace: which send fed which receive, and what a hop costs.

    messages = match_messages(trace.events)    # row indices of each send and its receive
    message_latency(trace.events)              # median seconds of a hop a receiver waited for

Pure numpy on the event rows (no MPI); read by analyze, export (flow arrows) and calibrate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpihybrid.analysis.rows import groups
from mpihybrid.trace.recorder import KIND


@dataclass
class Messages:
    """Matched point-to-point messages, as row indices into the events they came from."""

    send: np.ndarray  # index of the send row
    recv: np.ndarray  # index of the matching recv row
    direction: np.ndarray  # "F" (activation) or "B" (activation gradient), per message
    producer_end: np.ndarray  # end of the F/B whose output the message carried
    consumer_start: np.ndarray  # start of the F/B that consumed it

    def __len__(self) -> int:
        return len(self.send)


def match_messages(events: np.ndarray) -> Messages:
    """Pair every send with its receive: same step, replica and micro-batch, the same direction,
    and the receiving stage is the sender's neighbour (s + 1 for an activation, s - 1 for a
    gradient), which names the peer: the one rank of the replica that owns that stage.

    Rows do not say which way a message went, and with interleaving one stage sends activations
    and gradients to the same peer, so the direction is read from the order on the rank: a SEND
    follows the F or B that produced its tensor, a RECV precedes the F or B that consumes it
    (schedules.lower).
    """
    kind = events["kind"]
    fb = np.isin(kind, [KIND["forward"], KIND["backward"]])
    io = np.isin(kind, [KIND["send"], KIND["recv"]])
    rows = np.flatnonzero(fb | io)
    # every F/B/SEND/RECV row's (rank, step, stage, micro-batch), grouped once
    keys, key_of = groups(*(events[n][rows] for n in ("rank", "step", "stage", "microbatch")))
    start, end = events["start"][rows], events["end"][rows]
    times = {d: np.full((len(keys), 2), np.nan) for d in "FB"}  # (start, end) of its F and its B
    for d, name in (("F", "forward"), ("B", "backward")):
        mine = kind[rows] == KIND[name]
        times[d][key_of[mine]] = np.stack([start[mine], end[mine]], axis=1)
    has_compute = ~np.isnan(times["F"][:, 0]) | ~np.isnan(times["B"][:, 0])

    def pick(which: np.ndarray, later: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows `which` (indices into rows): the F or B of its key that a receive feeds (the
        first to start after the wait began) or that fed a send (the last to end before it
        began): found, is-F, and that F/B's start (receive) or end (send)."""
        k, t = key_of[which], start[which]
        col = 0 if later else 1
        f, b = times["F"][k, col], times["B"][k, col]
        with np.errstate(invalid="ignore"):
            f_ok, b_ok = (f >= t, b >= t) if later else (f <= t, b <= t)
            # ties go to B for a receive, to F for a send (the order of the names)
            f_wins = f_ok & (~b_ok | ((f < b) if later else (f >= b)))
        return f_ok | b_ok, f_wins, np.where(f_wins, f, b)

    recv = np.flatnonzero((kind[rows] == KIND["recv"]) & has_compute[key_of])
    send = np.flatnonzero((kind[rows] == KIND["send"]) & has_compute[key_of])
    found, recv_f, consumer = pick(recv, later=True)
    recv, recv_f, consumer = recv[found], recv_f[found], consumer[found]
    found, send_f, producer = pick(send, later=False)
    send, send_f, producer = send[found], send_f[found], producer[found]

    # a send meets the receive of the same step, replica, micro-batch and direction on the
    # neighbour stage: s + 1 for an activation, s - 1 for a gradient
    def meeting(idx: np.ndarray, is_f: np.ndarray, stage: np.ndarray) -> list[np.ndarray]:
        r = rows[idx]
        return [events["step"][r], events["replica"][r], stage, events["microbatch"][r], is_f]

    dest = events["stage"][rows[send]] + np.where(send_f, 1, -1)
    both = [
        np.concatenate([a, b])
        for a, b in zip(
            meeting(recv, recv_f, events["stage"][rows[recv]]),
            meeting(send, send_f, dest),
            strict=True,
        )
    ]
    _, meet_of = groups(*both)
    recv_at = np.full(len(recv) + len(send), -1, dtype=np.int64)
    recv_at[meet_of[: len(recv)]] = np.arange(len(recv))  # a repeated receive: the last one
    hit = recv_at[meet_of[len(recv) :]]
    ok = hit >= 0
    send, send_f, producer, hit = send[ok], send_f[ok], producer[ok], hit[ok]
    return Messages(
        send=rows[send].astype(np.int64),
        recv=rows[recv[hit]].astype(np.int64),
        direction=np.where(send_f, "F", "B").astype("<U1"),
        producer_end=producer.astype(np.float64),
        consumer_start=consumer[hit].astype(np.float64),
    )


def message_latency(
    events: np.ndarray, messages: Messages | None = None, mean: bool = False
) -> float:
    """Median seconds from the end of a producing F/B to the start of its consumer on another
    rank, over the messages whose receiver was already waiting (so the gap is the hop itself:
    send post, transfer, wake-up); 0.0 when no receiver ever waited. mean: the mean instead, what
    the hops cost in total (a rank waiting for a core makes a few hops long: the median is a
    typical hop, the mean what the bubble pays). Never below 0: a negative figure is the error
    of the ranks' clock offsets (trace.recorder.clock_offset) over a few hops, not a hop."""
    messages = messages if messages is not None else match_messages(events)
    if not len(messages):
        return 0.0
    waited = events["start"][messages.recv] <= events["start"][messages.send]
    hops = (messages.consumer_start - messages.producer_end)[waited]
    if not len(hops):
        return 0.0
    return max(0.0, float(np.mean(hops) if mean else np.median(hops)))
