"""Each rank's main thread, step by step: the rows that thread ran in order, its step's bounds,
and which send fed each receive. What the critical path (critical.py) and the idle attribution
(idle.py) walk.

    lanes = Lanes.of(trace.events)
    rows = lanes.rows(step, rank)     # indices into events, in start order
    lanes.window(step, rank)          # (start, end) of that rank's step row

Pure numpy on the event rows; one sort, then slices (linear in the events).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpihybrid.analysis.costs import CODE, find_rows, with_shares
from mpihybrid.analysis.messages import match_messages
from mpihybrid.trace.recorder import COMPUTE, KIND, VOCAB, VOCAB_PASSES

# what a rank's main thread does, one after the other (allreduce and optimizer rows may run on
# the communication thread, behind these); model.vocab_parallel's passes are compute too
MAIN = ("forward", "backward", "weight", "send", "recv", "grad_wait", *VOCAB_PASSES)
LETTER = COMPUTE | VOCAB
COMPUTE_CODES = tuple(LETTER)


class LanesError(ValueError):
    """A trace the walk cannot read (no per-action events, no step rows)."""


@dataclass
class Lanes:
    events: np.ndarray
    order: np.ndarray  # main-thread row indices sorted by (step, rank, start)
    keys: dict[tuple[int, int], tuple[int, int]]  # (step, rank) -> slice of order
    steps: dict[tuple[int, int], tuple[float, float]]  # (step, rank) -> its step row's bounds
    sender: dict[int, int]  # recv row -> its matched send row
    carried: dict[int, str]  # send row -> "F" (an activation) or "B" (its gradient)
    ring: dict[int, dict[tuple[int, int], list[int]]]  # step -> (stage, bucket) -> ring rows

    @classmethod
    def of(cls, events: np.ndarray) -> Lanes:
        """events: a vocabulary pass's stage reads as its share here (costs.with_shares)."""
        events = with_shares(events)
        kind = events["kind"]
        if not np.any(np.isin(kind, list(COMPUTE))):
            raise LanesError("the trace has no per-action events (trace.events = false?)")
        main = np.flatnonzero(np.isin(kind, [KIND[k] for k in MAIN]))
        # ties in start (a zero-length row beside an action): the longer one last
        by = (
            events["end"][main],
            events["start"][main],
            events["rank"][main],
            events["step"][main],
        )
        order = main[np.lexsort(by)]
        step, rank = events["step"][order], events["rank"][order]
        cut = np.flatnonzero((np.diff(step) != 0) | (np.diff(rank) != 0)) + 1
        bounds = np.concatenate([[0], cut, [len(order)]])
        keys = {
            (int(step[a]), int(rank[a])): (int(a), int(b))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            if b > a
        }
        rows = np.flatnonzero(kind == KIND["step"])
        steps = {
            (int(events["step"][i]), int(events["rank"][i])): (
                float(events["start"][i]),
                float(events["end"][i]),
            )
            for i in rows
        }
        if not steps:
            raise LanesError("the trace has no step rows")
        messages = match_messages(events)
        sender = dict(zip(messages.recv.tolist(), messages.send.tolist(), strict=True))
        carried = dict(zip(messages.send.tolist(), messages.direction.tolist(), strict=True))
        for recv, producer in _vocab_senders(events, order).items():
            sender[recv] = producer
            carried[producer] = LETTER[int(kind[producer])]
        ring: dict[int, dict[tuple[int, int], list[int]]] = {}
        for i in np.flatnonzero(kind == KIND["allreduce"]).tolist():
            step = ring.setdefault(int(events["step"][i]), {})
            step.setdefault((int(events["stage"][i]), int(events["microbatch"][i])), []).append(i)
        return cls(events, order, keys, steps, sender, carried, ring)

    def rows(self, step: int, rank: int) -> np.ndarray:
        a, b = self.keys.get((step, rank), (0, 0))
        return self.order[a:b]

    def window(self, step: int, rank: int) -> tuple[float, float] | None:
        return self.steps.get((step, rank))

    def step_numbers(self) -> list[int]:
        return sorted({s for s, _ in self.steps})

    def ranks(self, step: int) -> list[int]:
        return sorted(r for s, r in self.steps if s == step)


def _vocab_senders(events: np.ndarray, order: np.ndarray) -> dict[int, int]:
    """model.vocab_parallel's receives -> the row of the action that made what they carried (its
    message leaves as it ends), by the rank's next action: an S waits for the last stage's F, a
    T for the sender's S, a G for the first stage's B, the first stage's F for the sender's E,
    the last stage's B for the sender's T (costs.with_shares moved those two past the wait)."""
    kind = events["kind"][order]
    at = np.flatnonzero((kind == KIND["recv"]) & (events["stage"][order] < 0))
    if not len(at):
        return {}
    # the first row after each that is no receive (a T takes every other share's statistics)
    index = np.where(kind != KIND["recv"], np.arange(len(order)), len(order) - 1)
    after = np.minimum.accumulate(index[::-1])[::-1]
    recv, consumer = order[at], order[after[at]]
    same = (events["rank"][consumer] == events["rank"][recv]) & (
        events["step"][consumer] == events["step"][recv]
    )
    recv, consumer = recv[same], consumer[same]
    last = int(events["stage"][events["kind"] == KIND["forward"]].max())
    made = {"S": ("F", last), "T": ("S", None), "G": ("B", 0), "F": ("E", None), "B": ("T", None)}
    out = {}
    for letter, (producer, stage) in made.items():
        mine = events["kind"][consumer] == CODE[letter]
        if not mine.any():
            continue
        rows = np.flatnonzero(events["kind"] == CODE[producer])
        want = events[recv[mine]]
        table = [events["step"][rows], events["rank"][rows], events["microbatch"][rows]]
        query = [want["step"], want["peer"], want["microbatch"]]
        if stage is not None:  # a pass's input is the sender's own pass: its rank names it
            table.append(events["stage"][rows])
            query.append(np.full(len(want), stage))
        found = find_rows(table, query)
        out.update(
            zip(recv[mine][found >= 0].tolist(), rows[found[found >= 0]].tolist(), strict=True)
        )
    return out


def waited(events: np.ndarray, recv: int, send: int | None) -> bool:
    """Whether a receive blocked on its message: the message's send ended after it began."""
    return send is not None and events["end"][send] > events["start"][recv]


def action_name(letter: str, stage: int, microbatch: int) -> str:
    """ "F3 of stage 1", "S3 of vocabulary share 1"."""
    where = "vocabulary share" if letter in VOCAB.values() else "stage"
    return f"{letter}{microbatch} of {where} {stage}"
