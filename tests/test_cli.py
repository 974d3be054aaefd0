"""The command line: every command has help; schedule show; bench allreduce under mpiexec."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mpihybrid.cli import main
from tests.helpers import run_mpi

COMMANDS = ["train", "schedule", "bench", "analyze", "timeline", "export", "compare", "sweep"]


def test_every_command_has_help():
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0
    for name in COMMANDS:
        assert name in top.output
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, name


def test_schedule_show_prints_grid_bubble_and_memory():
    result = CliRunner().invoke(
        main, ["schedule", "show", "--schedule", "1f1b", "--pp", "4", "-m", "8"]
    )
    assert result.exit_code == 0, result.output
    assert "rank 3" in result.output and "B7" in result.output
    assert "0.273" in result.output  # (p-1)/(m+p-1) = 3/11
    assert "s0:4" in result.output  # 1F1B keeps min(pp, M) activations on stage 0


def test_schedule_show_early_grad_send_draws_the_split_backward():
    args = ["schedule", "show", "--pp", "2", "-m", "4", "--early-grad-send"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "gradients sent before W" in result.output and "W3" in result.output
    assert "simulated 0.143" in result.output  # 14 steps, 4 of them idle on the two ranks
    assert "s0:2 s1:1" in result.output  # the schedule's own memory


def test_schedule_show_all_compares_every_schedule():
    result = CliRunner().invoke(main, ["schedule", "show", "--all", "--pp", "4", "-m", "8"])
    assert result.exit_code == 0, result.output
    for name in ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert name in result.output


@pytest.mark.parametrize(
    "args",
    [["--schedule", "pipedream"], ["--schedule", "interleaved-1f1b", "--pp", "4", "-m", "6"]],
)
def test_schedule_show_bad_input_exits_2(args):
    result = CliRunner().invoke(main, ["schedule", "show", *args])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "mpihybrid: error:" in result.output


@pytest.mark.mpi
def test_bench_allreduce_prints_ring_and_mpi_rows():
    proc = run_mpi(2, "-m", "mpihybrid", "bench", "allreduce", "--sizes", "4K,64K",
                   "--codecs", "fp32,int8", "--repeats", "1", timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "KiB" in line]
    assert len(lines) == 2 * 3  # per size: mpi, ring fp32, ring int8
    assert any("ring" in line and "int8" in line for line in lines)


@pytest.mark.mpi
def test_bench_allreduce_rejects_an_unknown_codec():
    proc = run_mpi(2, "-m", "mpihybrid", "bench", "allreduce", "--codecs", "int4", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mpihybrid: error: unknown codec 'int4'; choose from fp32, fp16, bf16, int8"
    ]


def test_a_bad_kernel_choice_is_one_line_and_exit_2():
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**os.environ, "MPIHYBRID_KERNELS": "bogus", "PYTHONPATH": str(ROOT)}
    for args in (["--help"], ["bench", "codecs"]):
        proc = subprocess.run([sys.executable, "-m", "mpihybrid", *args], capture_output=True,
                              text=True, env=env, timeout=60)  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr  # was a traceback
        assert "MPIHYBRID_KERNELS='bogus': choose one of auto, numpy, numba" in lines[0]


def test_schedule_show_names_a_whole_backward_and_has_a_legend():
    args = ["schedule", "show", "--schedule", "1f1b", "--pp", "2", "-m", "2"]
    result = CliRunner().invoke(main, [*args, "--early-grad-send"])
    rank0 = [line.split()[2] for line in result.output.splitlines() if line.startswith("step ")]
    assert rank0 == ["F0", "F1", "-", "BW0", "~", "-", "BW1", "~"]  # was "B0 B0"
    assert "BW a whole backward (B and W in one action) and ~ its second step" in result.output
    plain = CliRunner().invoke(main, args).output
    assert "F forward, B backward, - idle" in plain and "BW" not in plain
