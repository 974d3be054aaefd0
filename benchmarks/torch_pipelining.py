"""The same GPT workload on torch.distributed.pipelining (gloo, one thread per process), for a
side-by-side figure on the same machine. Optional: needs PyTorch, never runs in CI.

    pip install torch            # CPU build
    python benchmarks/torch_pipelining.py --schedule 1f1b     # spawns 2 processes
    python benchmarks/torch_pipelining.py --schedule gpipe --split 2

The workload is jobs/gpt_bench.toml's: random tokens, vocab 10000, width 240, 4 pre-norm layers
(4 heads, FFN 2048, GELU, causal), final LayerNorm, linear head, batch 8 x 64 in 4 micro-batches,
2 stages, Adam, fp32. `--split` is how many layers the first stage holds (3 = what mpihybrid's
cost partition picks; 2 = an even split of the layers). Prints tokens/s (median of repeats).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

VOCAB, WIDTH, LAYERS, HEADS, FFN, SEQ, BATCH, MICRO = 10000, 240, 4, 4, 2048, 64, 8, 4


def build_stage_module(torch, first: bool, layers: int):
    nn = torch.nn

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

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, WIDTH)
            self.positions = nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1])
            return self.blocks(self.tokens(tokens) + self.positions(pos))

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, x):
            return self.head(self.norm(self.blocks(x)))

    return First() if first else Last()


def worker(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    module = build_stage_module(torch, rank == 0, args.split if rank == 0 else LAYERS - args.split)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    ce = torch.nn.CrossEntropyLoss()

    def loss_fn(logits, target):
        return ce(logits.reshape(-1, VOCAB), target.reshape(-1))

    schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(seq[:, :-1])
        else:
            schedule.step(target=seq[:, 1:], losses=[])
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
        print(
            f"torch.distributed.pipelining {args.schedule}, "
            f"split {args.split}/{LAYERS - args.split}: "
            f"{statistics.median(rates):,.0f} tokens/s (median; repeats: "
            + ", ".join(f"{r:,.0f}" for r in rates)
            + f"), torch {torch.__version__}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--split", type=int, default=3, help="layers on the first stage")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
