"""The benchmark scripts run at their smallest sizes (figures are never asserted)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_runtime_overhead_runs_two_steps_and_refuses_one():
    script = [sys.executable, "benchmarks/runtime_overhead.py", "--microbatches", "2"]
    proc = subprocess.run([*script, "--steps", "2"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "per action" in proc.stdout, proc.stderr[-2000:]  # crashed
    proc = subprocess.run([*script, "--steps", "1"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "needs at least 2" in proc.stderr


def test_codec_convergence_refuses_an_unknown_codec_in_one_line():
    script = [sys.executable, "benchmarks/codec_convergence.py", "--codecs", "fp32,gather-int4"]
    proc = subprocess.run(script, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "gather-int4" in proc.stderr and "gather-int8" in proc.stderr


def test_gemm_ab_merged_and_input_gradient_modes_run_and_refuse_a_negative_merge():
    script = [sys.executable, "benchmarks/gemm_ab.py", "--rows", "8", "--rounds", "1"]
    for mode, needle in ((["--merge", "2"], "merged/separate"), (["--input-grad"], "same bits")):
        proc = subprocess.run([*script, *mode], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0 and needle in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([*script, "--merge", "-1"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--merge is 0 (off) or more" in proc.stderr, proc.stderr


def test_merged_w_runs_two_microbatches_and_refuses_a_merge_of_one_in_one_line():
    script = [sys.executable, "benchmarks/merged_w.py", "--rows", "64", "--rounds", "1"]
    proc = subprocess.run([*script, "--merge", "2"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "merged/separate" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([*script, "--merge", "1"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--merge at least 2" in proc.stderr
