"""Stragglers found (docs/analysis.md): N runs of the laptop job (pp = 2 x dp = 2, or --pp 1:
1 x 2) with rank 1's forwards slowed 1.3x (train.slowdown = 1:F:1.3), N healthy runs and N runs
with rank 1 on a 1.3x slower device (1:D:1.3: every action and its core probe); for each,
whether analyze names the slowed rank (and nothing else), the step of the live line, and
whether the slower device is reported as one and not named.

    flock -x /tmp/mh_heavy.lock python benchmarks/straggler_runs.py runs/strag --runs 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def run(folder: Path, name: str, slow: str, steps: int, pp: int) -> dict:
    path = folder / f"{name}.h5"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    cmd = [mpiexec, "-n", str(2 * pp), sys.executable, "-m", "mpihybrid", "train",
           "mpihybrid/jobs/laptop.toml", "--set", f"train.steps={steps}", "--trace", str(path),
           "--set", "trace.overwrite=true", "--set", f"train.slowdown={slow}",
           "--set", f"grid.pp={pp}", "--set", "grid.dp=2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    live = [line for line in out.splitlines() if "straggler:" in line]
    step = None
    if live:  # the step line just before the straggler line
        before = out[: out.index(live[0])]
        found = re.findall(r"step (\d+)/", before)
        step = int(found[-1]) if found else None
    doc = json.loads(
        subprocess.run([sys.executable, "-m", "mpihybrid", "analyze", str(path), "--json"],
                       capture_output=True, text=True, env=env, check=True).stdout
    )  # fmt: skip
    found = doc["why"]["stragglers"]
    named = [(s["rank"], s["kind"]) for s in found["named"]]
    devices = [d["rank"] for d in found.get("devices", [])]
    return {"name": name, "named": named, "devices": devices, "live": live, "live_step": step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pp", type=int, default=2, help="2: 4 ranks; 1: 2 ranks (dp = 2)")
    args = parser.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    hit = clean = live_ok = quiet_ok = told = device_clean = device_quiet = 0
    for i in range(args.runs):
        for name, slow in (("slow", "1:F:1.3"), ("healthy", ""), ("device", "1:D:1.3")):
            r = run(folder, f"{name}{i}", slow, args.steps, args.pp)
            print(json.dumps(r), flush=True)
            if name == "slow":
                hit += bool(r["named"]) and r["named"][0] == (1, "F")
                live_ok += any("rank 1 (stage" in line and ") F" in line for line in r["live"])
            elif name == "healthy":
                clean += not r["named"]
                quiet_ok += not r["live"]
            else:
                told += r["devices"] == [1]
                device_clean += not r["named"]
                device_quiet += not r["live"]
    n = args.runs
    print(f"slowed: named first {hit}/{n}, live line {live_ok}/{n}; healthy: nothing named "
          f"{clean}/{n}, no live line {quiet_ok}/{n}; slower device: reported {told}/{n}, "
          f"nothing named {device_clean}/{n}, no live line {device_quiet}/{n}")  # fmt: skip


if __name__ == "__main__":
    main()
