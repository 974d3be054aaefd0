"""The schedules of the loop placement (stage s on rank s % p), one rank's compute list each:
naive, GPipe, 1F1B, zero-bubble H1 and interleaved 1F1B (schedules.SPECS registers them;
v_schedules.py holds the V placement's).

p = pp (pipeline ranks), v = model chunks (stages) per rank, m = num_microbatches,
s = global stage 0 .. p*v-1, mb = micro-batch.
"""

from __future__ import annotations

from mpihybrid.pipeline.actions import Action


def naive(pp: int, m: int, rank: int) -> list[Action]:
    # one micro-batch crosses the whole pipe forward and back before the next one starts
    return [Action(rank, k, mb) for mb in range(m) for k in ("F", "B")]


def gpipe(pp: int, m: int, rank: int) -> list[Action]:
    # all forwards, then all backwards: every activation stays alive until the flush
    return [Action(rank, "F", mb) for mb in range(m)] + [Action(rank, "B", mb) for mb in range(m)]


def one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    num_warmup = min(pp - rank - 1, m)
    num_steady = m - num_warmup
    # warmup: forwards only
    actions = [Action(rank, "F", mb) for mb in range(num_warmup)]
    # steady state: one F, one B
    for i in range(num_steady):
        actions += [Action(rank, "F", num_warmup + i), Action(rank, "B", i)]
    # cooldown: drain backwards
    actions += [Action(rank, "B", mb) for mb in range(num_steady, m)]
    return actions


def zb_h1(pp: int, m: int, rank: int) -> list[Action]:
    # 1F1B with the backward split into B (input grad, on the critical path) and W (weight grad).
    # Rank r keeps r Ws back; they fill the cooldown, where 1F1B waits for gradients. Peak memory
    # stays at p in-flight micro-batches, the peak of 1F1B's first rank.
    num_warmup = min(pp - rank - 1, m)
    num_deferred = min(rank, m - num_warmup)
    num_steady = m - num_warmup - num_deferred
    f, b, w = num_warmup, 0, 0  # next micro-batch for F, B, W
    # warmup: forwards only
    actions = [Action(rank, "F", mb) for mb in range(num_warmup)]
    # ramp: one F, one B; the W waits
    for _ in range(num_deferred):
        actions += [Action(rank, "F", f), Action(rank, "B", b)]
        f, b = f + 1, b + 1
    # steady state: one F, one B, the oldest W
    for _ in range(num_steady):
        actions += [Action(rank, "F", f), Action(rank, "B", b), Action(rank, "W", w)]
        f, b, w = f + 1, b + 1, w + 1
    # cooldown: drain backwards, each with a W, then the Ws kept back
    for _ in range(b, m):
        actions += [Action(rank, "B", b), Action(rank, "W", w)]
        b, w = b + 1, w + 1
    return actions + [Action(rank, "W", mb) for mb in range(w, m)]


def interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # Megatron-LM / torch pipelining: rank r walks "virtual micro-batches" k = 0 .. m*v-1 in rounds
    # of p micro-batches per chunk; forwards go chunk 0 -> v-1, backwards chunk v-1 -> 0.
    total = m * v
    num_warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def action(k: int, kind: str) -> Action:
        chunk = (k % (pp * v)) // pp
        if kind == "B":
            chunk = v - 1 - chunk
        microbatch = (k // (pp * v)) * pp + k % pp
        return Action(chunk * pp + rank, kind, microbatch)

    # warmup: forwards only
    actions = [action(k, "F") for k in range(num_warmup)]
    # steady state: one F, one B
    for k in range(total - num_warmup):
        actions += [action(num_warmup + k, "F"), action(k, "B")]
    # cooldown: drain backwards
    actions += [action(k, "B") for k in range(total - num_warmup, total)]
    return actions


# ---------------------------------------------------------------- the registry
