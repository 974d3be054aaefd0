"""One command, two checkouts of mpihybrid, paired: is A slower than B?

    python benchmarks/ab_checkouts.py NEW OLD --rounds 4 -- \
        mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml --repeats 4 --json

Each run starts in the checkout with PYTHONPATH=<checkout> (that checkout's mpihybrid is the one
imported, from the same installed dependencies; relative paths such as a job file are its own)
and prints JSON on stdout whose `--key` (default "throughput",
bench train's tokens/s: higher is faster) is the figure. Rounds alternate the order, ABBA: round
0 runs A then B, round 1 B then A, ..., so a drift of the machine's speed within a round falls
on both sides alike. Each round's ratio A/B pairs the two runs of that round; the summary is the
median ratio with its spread (min..max over rounds) and each checkout's median figure, with the
load average (1 min) at the start of every run. Give the same checkout twice for an A/A pair:
the noise floor the A/B spread must be read against.

--lock PATH: each round takes an exclusive flock on PATH (the two runs of a round under one
hold, released between rounds so that a shared machine's other timings get their turn).
Old checkouts: `git worktree add /tmp/old COMMIT` makes one beside yours.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def held(path: str | None):
    """An exclusive flock on `path` for the block (none without a path)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_once(checkout: str, command: list[str], key: str, env: dict) -> tuple[float, float]:
    """(figure, load average at the start) of one run of `command` from `checkout`."""
    load = os.getloadavg()[0]
    proc = subprocess.run(
        command,
        cwd=checkout,
        env=env | {"PYTHONPATH": checkout},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(f"{checkout}: exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
    # the JSON object is the last thing on stdout (progress lines go to stderr)
    text = proc.stdout[proc.stdout.index("{") :] if "{" in proc.stdout else proc.stdout
    return float(json.loads(text)[key]), load


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s A B [options] -- COMMAND ..."
    )
    parser.add_argument("a", help="checkout A (the one asked about: the new code)")
    parser.add_argument("b", help="checkout B (the reference: the old code, or A again)")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (2 runs each)")
    parser.add_argument("--key", default="throughput", help="the JSON figure (higher: faster)")
    parser.add_argument("--lock", default="", help="flock this file for each round")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # the command follows --
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if not command or args.rounds < 1:
        parser.error("give --rounds >= 1 and a command after --")
    for checkout in (args.a, args.b):
        if not (Path(checkout) / "mpihybrid" / "__init__.py").is_file():
            parser.error(f"{checkout} is not an mpihybrid checkout")
    env = dict(os.environ)
    rounds = []
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        with held(args.lock):
            got = {side: run_once(getattr(args, side), command, args.key, env) for side in order}
        ratio = got["a"][0] / got["b"][0]
        rounds.append(
            {
                "round": r,
                "order": "".join(order).upper(),
                "ratio": ratio,
                "a": got["a"][0],
                "b": got["b"][0],
                "load": [got[s][1] for s in order],
                "at": time.strftime("%H:%M:%S"),
            }
        )
        print(
            f"round {r} ({rounds[-1]['order']}, {rounds[-1]['at']}): A {got['a'][0]:.1f}  "
            f"B {got['b'][0]:.1f}  A/B {ratio:.3f}  load {got['a'][1]:.1f}/{got['b'][1]:.1f}",
            file=sys.stderr,
        )
    ratios = [x["ratio"] for x in rounds]
    loads = [v for x in rounds for v in x["load"]]
    result = {
        "a": args.a,
        "b": args.b,
        "command": command,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_a": statistics.median(x["a"] for x in rounds),
        "median_b": statistics.median(x["b"] for x in rounds),
        "load": [min(loads), max(loads)],
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"A/B median {result['median_ratio']:.3f} ({result['min_ratio']:.3f}.."
        f"{result['max_ratio']:.3f}) over {len(rounds)} rounds; median A "
        f"{result['median_a']:.1f}, B {result['median_b']:.1f} ({args.key}); load average "
        f"{min(loads):.1f}..{max(loads):.1f}"
    )


if __name__ == "__main__":
    main()
