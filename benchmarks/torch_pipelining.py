"""The same GPT workload on torch.distributed.pipelining (gloo, one thread per process), for a
side-by-side figure on the same machine. Optional: needs PyTorch, never runs in CI.

    pip install torch            # CPU build
    python benchmarks/torch_pipelining.py --schedule 1f1b     # spawns 2 processes
    python benchmarks/torch_pipelining.py --schedule gpipe --split 2
    python benchmarks/torch_pipelining.py --schedule zbv      # two stages a rank (a V)
    python benchmarks/torch_pipelining.py --best              # every schedule: the fastest

The workload is jobs/gpt_bench.toml's: random tokens, vocab 10000, width 240, 4 pre-norm layers
(4 heads, FFN 2048, GELU, causal), final LayerNorm, linear head, batch 8 x 64 in 4 micro-batches,
2 stages, Adam, fp32. `--split` is how many layers the first stage holds (3 = what mpihybrid's
cost partition picks; 2 = an even split of the layers). The schedules with two stages a rank
(interleaved, interleaved-zb: a loop, rank 0 holding stages 0 and 2; zbv, dualpipev: a V, rank 0
holding stages 0 and 3) cut the model into 4 stages of `--stage-layers` layers each (the embedding
on stage 0, the final LayerNorm and head on stage 3); the defaults balance the two ranks' FLOPs
with the head counted as about 2 layers (loop 2,1,1,0; V 1,2,1,0). Prints tokens/s (median of
repeats); `--best` runs every schedule in turn and names the fastest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

VOCAB, WIDTH, LAYERS, HEADS, FFN, SEQ, BATCH, MICRO = 10000, 240, 4, 4, 2048, 64, 8, 4
ONE_STAGE = ("1f1b", "gpipe")  # a stage a rank
LOOP, V = ("interleaved", "interleaved-zb"), ("zbv", "dualpipev")  # two stages a rank
SCHEDULES = ONE_STAGE + LOOP + V
DEFAULT_STAGE_LAYERS = {"loop": (2, 1, 1, 0), "v": (1, 2, 1, 0)}


def build_stage_module(torch, first: bool, layers: int, last: bool | None = None):
    """A stage of `layers` blocks; the first holds the embeddings, the last the norm and head
    (by default the first stage's other is the last: two stages)."""
    nn = torch.nn
    last = not first if last is None else last

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(
                WIDTH, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True,
                norm_first=True,
            )  # fmt: skip
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

        def forward(self, x):
            return self.layer(x, src_mask=self.mask, is_causal=True)

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            if first:
                self.tokens = nn.Embedding(VOCAB, WIDTH)
                self.positions = nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            if last:
                self.norm = nn.LayerNorm(WIDTH)
                self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, x):
            if first:
                x = self.tokens(x) + self.positions(torch.arange(x.shape[1]))
            x = self.blocks(x)
            return self.head(self.norm(x)) if last else x

    return Stage()


def _stages(args, rank: int) -> list[tuple[int, bool, bool, int]]:
    """(stage index, first, last, layers) of each stage this rank holds."""
    if args.schedule in ONE_STAGE:
        layers = args.split if rank == 0 else LAYERS - args.split
        return [(rank, rank == 0, rank == 1, layers)]
    placement = "loop" if args.schedule in LOOP else "v"
    per_stage = args.stage_layers or DEFAULT_STAGE_LAYERS[placement]
    if len(per_stage) != 4 or sum(per_stage) != LAYERS:
        raise SystemExit(f"--stage-layers: 4 counts adding up to {LAYERS}, got {per_stage}")
    held = (rank, rank + 2) if placement == "loop" else (rank, 3 - rank)
    return [(i, i == 0, i == 3, per_stage[i]) for i in held]


def worker(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pipe

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    held = _stages(args, rank)
    total = 2 * len(held)
    modules = [build_stage_module(torch, first, layers, last) for _, first, last, layers in held]
    stages = [
        pipe.PipelineStage(m, index, total, torch.device("cpu"))
        for m, (index, *_) in zip(modules, held, strict=True)
    ]
    holds_first = any(first for _, first, _, _ in held)
    holds_last = any(last for _, _, last, _ in held)
    ce = torch.nn.CrossEntropyLoss()

    def loss_fn(logits, target):
        return ce(logits.reshape(-1, VOCAB), target.reshape(-1))

    classes = {
        "1f1b": pipe.Schedule1F1B, "gpipe": pipe.ScheduleGPipe,
        "interleaved": pipe.ScheduleInterleaved1F1B,
        "interleaved-zb": pipe.ScheduleInterleavedZeroBubble,
        "zbv": pipe.ScheduleZBVZeroBubble, "dualpipev": pipe.ScheduleDualPipeV,
    }  # fmt: skip
    given = stages[0] if args.schedule in ONE_STAGE else stages
    schedule = classes[args.schedule](given, n_microbatches=MICRO, loss_fn=loss_fn)
    parameters = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=3e-4)
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        inputs = (seq[:, :-1],) if holds_first else ()
        targets = {"target": seq[:, 1:], "losses": []} if holds_last else {}
        schedule.step(*inputs, **targets)
        optimizer.step()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.repeats):
        took = sum(step() for _ in range(args.steps))
        rates.append(args.steps * BATCH * SEQ / took)
    if rank == 0:
        every = sorted(held + _stages(args, 1))
        split = "/".join(str(layers) for *_, layers in every)
        print(
            f"torch.distributed.pipelining {args.schedule}, split {split}: "
            f"{statistics.median(rates):,.0f} tokens/s (median; repeats: "
            + ", ".join(f"{r:,.0f}" for r in rates)
            + f"), torch {torch.__version__}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--best", action="store_true", help="every schedule; name the fastest")
    parser.add_argument(
        "--stage-layers", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
        help="layers of each of the 4 stages (two stages a rank), e.g. 1,2,1,0",
    )  # fmt: skip
    parser.add_argument("--split", type=int, default=3, help="layers on the first stage")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.best:
        _best(args)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args,), nprocs=2, join=True)


def _best(args) -> None:
    """Each schedule in a process of its own, one after another; the fastest named last."""
    import re
    import subprocess
    import sys

    rates = {}
    for name in SCHEDULES:
        argv = [sys.executable, __file__, "--schedule", name, "--warmup", str(args.warmup),
                "--steps", str(args.steps), "--repeats", str(args.repeats),
                "--split", str(args.split), "--port", str(args.port)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        print(line, flush=True)
        if found := re.search(r": ([\d,]+) tokens/s", line):
            rates[name] = float(found.group(1).replace(",", ""))
    if rates:
        best = max(rates, key=rates.get)
        print(f"best: torch.distributed.pipelining {best}, {rates[best]:,.0f} tokens/s")


if __name__ == "__main__":
    main()
