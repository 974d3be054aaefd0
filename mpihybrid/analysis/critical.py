"""The critical path of each traced step across ranks: the chain of actions, message hops and
runtime gaps that set the step's time.

    paths = critical_paths(Lanes.of(trace.events))     # one Path per step
    shares(paths)                                      # {"F s0": 0.31, "hop": 0.02, ...}

The walk starts at the end of the step on the last rank to finish and goes back in time: on a
rank, the main-thread row before the current time is on the path (a compute action, a send's
post, a receive that found its message there, the wait for the gradient buckets), the time
between two rows a runtime gap; a receive that blocked on its message leaves the rank through
the message (a hop from the send's end to the receive's end) to the sender at its send's end;
a wait for the gradient ring whose bucket a replica began later leaves to that replica when it
began. It ends at the step's start on the rank it reached. Links never overlap and tile the
path, so the links' seconds add up to the path's length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from mpihybrid.analysis.lanes import LETTER, Lanes, action_name, waited
from mpihybrid.trace.recorder import KIND, VOCAB

# the kinds of link, as shares() names them (compute links are "F s0", "B s1", "W s1", ...)
HOP, RUNTIME, GRAD, OPTIM = "hop", "runtime", "gradient wait", "optimizer"
MAX_LINKS = 1 << 20  # a walk longer than this is a trace whose times go round in circles


@dataclass
class Link:
    kind: str  # "F", "B", "W", "E", "S", "T", "G", "hop", "send", "recv", "gap", "grad_wait"
    rank: int
    start: float
    end: float
    stage: int = -1  # a vocabulary pass (E, S, T, G): its share
    microbatch: int = -1
    peer: int = -1  # hop: the sender; grad_wait: the replica the ring waited for
    optimizer: float = 0.0  # seconds of this compute link the optimizer's update ran inside

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def label(self) -> str:
        """The share this link counts in (shares())."""
        if self.kind in VOCAB.values():  # model.vocab_parallel's pass on a vocabulary share
            return f"vocab {self.kind} v{self.stage}"
        if self.kind in LETTER.values():
            return f"{self.kind} s{self.stage}"
        if self.kind == "hop":
            return HOP
        if self.kind == "grad_wait":
            return GRAD
        return RUNTIME

    def text(self) -> str:
        ms = f"{1e3 * self.seconds:.2f} ms"
        if self.kind in LETTER.values():
            return f"rank {self.rank} {action_name(self.kind, self.stage, self.microbatch)} {ms}"
        if self.kind == "hop":
            return f"hop rank {self.peer} -> {self.rank} {ms}"
        if self.kind == "grad_wait":
            peer = f" (ring waited for rank {self.peer})" if self.peer >= 0 else ""
            return f"rank {self.rank} gradient wait {ms}{peer}"
        return f"rank {self.rank} {self.kind} {ms}"

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "stage": self.stage,
            "microbatch": self.microbatch,
            "peer": self.peer,
            "start": self.start,
            "end": self.end,
            "optimizer": self.optimizer,
        }


@dataclass
class Path:
    step: int  # from 0
    links: list[Link] = field(default_factory=list)  # in time order

    @property
    def start(self) -> float:
        return self.links[0].start if self.links else 0.0

    @property
    def end(self) -> float:
        return self.links[-1].end if self.links else 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return {
            "step": self.step + 1,
            "seconds": self.seconds,
            "links": [k.as_dict() for k in self.links],
        }


def critical_paths(lanes: Lanes, steps: list[int] | None = None) -> list[Path]:
    """The critical path of each step (0-based; all of the trace's by default)."""
    return [_walk(lanes, s) for s in (steps if steps is not None else lanes.step_numbers())]


def _walk(lanes: Lanes, step: int) -> Path:
    ev = lanes.events
    ranks = lanes.ranks(step)
    rank = max(ranks, key=lambda r: lanes.window(step, r)[1])
    t = lanes.window(step, rank)[1]
    links: list[Link] = []
    per_rank = {r: lanes.rows(step, r) for r in ranks}
    starts = {r: ev["start"][rows].tolist() for r, rows in per_rank.items()}
    while len(links) < MAX_LINKS:
        begin = lanes.window(step, rank)[0]
        rows = per_rank.get(rank)
        i = bisect.bisect_left(starts[rank], t) - 1 if rows is not None else -1
        if i < 0 or ev["start"][rows[i]] < begin:
            if t > begin:
                links.append(Link("gap", rank, begin, t))
            break
        row = int(rows[i])
        end = min(float(ev["end"][row]), t)
        if end < t:
            links.append(Link("gap", rank, end, t))
            t = end
        code = int(ev["kind"][row])
        start = float(ev["start"][row])
        if code in LETTER:
            link = Link(LETTER[code], rank, start, t, int(ev["stage"][row]))
            link.microbatch = int(ev["microbatch"][row])
            links.append(link)
            t = start
        elif code == KIND["recv"] and waited(ev, row, lanes.sender.get(row)):
            send = lanes.sender[row]
            sent = min(float(ev["end"][send]), t)
            peer = int(ev["rank"][send])
            links.append(Link("hop", rank, sent, t, int(ev["stage"][row]), peer=peer))
            links[-1].microbatch = int(ev["microbatch"][row])
            rank, t = int(ev["rank"][send]), sent
        elif code == KIND["grad_wait"]:
            peer, began = _ring_waited_for(lanes, step, rank, start, t)
            if peer >= 0:
                links.append(Link("grad_wait", rank, began, t, peer=peer))
                rank, t = peer, began
            else:
                links.append(Link("grad_wait", rank, start, t))
                t = start
        else:  # a send's post, a receive whose message was there: the rank's own runtime
            links.append(Link(KIND_NAME[code], rank, start, t, int(ev["stage"][row])))
            t = start
    links.reverse()
    _optimizer_inside(lanes, step, links)
    return Path(step, links)


KIND_NAME = {code: name for name, code in KIND.items()}


def _ring_waited_for(lanes: Lanes, step: int, rank: int, start: float, t: float):
    """(replica rank, when its ring began) when the gradient wait ending at t waited for a ring
    bucket another replica began after `start`; (-1, 0.0) when it waited for none."""
    ev = lanes.events
    best, began = -1, start
    for rows in lanes.ring.get(step, {}).values():
        mine = [i for i in rows if int(ev["rank"][i]) == rank and ev["end"][i] <= t + 1e-9]
        if not mine:
            continue
        late = max(rows, key=lambda i: ev["start"][i])
        if int(ev["rank"][late]) != rank and began < ev["start"][late] < t:
            best, began = int(ev["rank"][late]), float(ev["start"][late])
    return best, began


def _optimizer_inside(lanes: Lanes, step: int, links: list[Link]) -> None:
    """Each compute link's seconds that its rank's optimizer rows ran inside (a CPU rank runs
    the buckets' updates within the stage's last weight-gradient action)."""
    ev = lanes.events
    opt = ev[(ev["kind"] == KIND["optimizer"]) & (ev["step"] == step)]
    if not len(opt):
        return
    for link in links:
        if link.kind not in LETTER.values():
            continue
        mine = opt[opt["rank"] == link.rank]
        overlap = np.minimum(mine["end"], link.end) - np.maximum(mine["start"], link.start)
        link.optimizer = float(np.clip(overlap, 0.0, None).sum())


def shares(paths: list[Path]) -> dict[str, float]:
    """The share of the paths' total time each kind of link holds (compute per stage and kind
    less the optimizer's update inside it, hops, runtime, gradient wait, optimizer); sums to 1."""
    seconds: dict[str, float] = {}
    for path in paths:
        for link in path.links:
            label = link.label()
            seconds[label] = seconds.get(label, 0.0) + link.seconds - link.optimizer
            if link.optimizer:
                seconds[OPTIM] = seconds.get(OPTIM, 0.0) + link.optimizer
    total = sum(seconds.values())
    if total <= 0:
        return {}
    return dict(sorted(((k, v / total) for k, v in seconds.items()), key=lambda kv: -kv[1]))


def representative(paths: list[Path]) -> Path | None:
    """The step whose path length is the median's (the lower one of an even count)."""
    if not paths:
        return None
    order = sorted(paths, key=lambda p: p.seconds)
    return order[(len(order) - 1) // 2]


def path_text(path: Path, limit: int = 40) -> list[str]:
    """The path as lines, a link each (runtime gaps under 1 % of the path folded into the next
    link's line); at most `limit` lines, the middle left out."""
    keep = [k for k in path.links if k.kind != "gap" or k.seconds >= 0.01 * path.seconds]
    lines = [k.text() for k in keep]
    if len(lines) > limit:
        half = limit // 2
        lines = [*lines[:half], f"... {len(lines) - 2 * half} links left out ...", *lines[-half:]]
    return lines
