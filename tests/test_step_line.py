"""Rank 0's step line (train.log_every) and the first run's "compiling kernels" notice, without
MPI: the line's figures from a made-up run, the notice from numba's cache files."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from mpihybrid import _numba
from mpihybrid.config import ConfigError, build_job, resolve
from mpihybrid.train import report


class OneRank:
    rank, size = 0, 2

    def allreduce(self, value, op=None):
        return 3 * 2**20  # every rank's peak resident set: 3 MiB


def made_up_run(steps_done: int, seconds: float, peak_flops=None) -> SimpleNamespace:
    return SimpleNamespace(log_from=(0, 100.0, 0.0), eval_s=0.0, losses=[0.5], accuracies=[0.75],
                           peak_flops=peak_flops, _now=100.0 + seconds)  # fmt: skip


def line(job, run, step, monkeypatch, caplog) -> str:
    monkeypatch.setattr(report.Recorder, "clock", staticmethod(lambda: run._now))
    with caplog.at_level(logging.INFO, logger=report.log.name):
        report.log_step(job, OneRank(), run, step, held_out_s=run.eval_s, peak_flops=run.peak_flops)
    return caplog.records[-1].getMessage()


def test_step_line_has_throughput_memory_and_time_left(monkeypatch, caplog):
    job = resolve(build_job({"train": {"steps": 30, "global_batch": 64}}), 2)
    text = line(job, made_up_run(10, 2.0), 9, monkeypatch, caplog)  # 10 steps in 2 s
    assert text == (
        "step 10/30  loss 0.5000  acc 0.750  lr 0.01  200.0 ms/step  320 samples/s  "
        "peak mem 3.00 MiB  left 4.0 s"
    )


def test_step_line_of_token_data_counts_tokens_and_the_roofline(monkeypatch, caplog):
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import block_costs, build_blocks

    job = resolve(build_job({"model": {"kind": "gpt", "hidden": 32, "depth": 2, "heads": 2},
                             "data": {"kind": "random-tokens", "vocab": 64, "seq_len": 16},
                             "train": {"steps": 10, "global_batch": 8}}), 2)  # fmt: skip
    flops = sum(block_costs(build_blocks(job.model, *task_dims(job.data))))
    tokens_per_s = 8 * 16 / 0.5
    peak = flops * tokens_per_s / 2 / 0.25  # each of the 2 ranks at a quarter of its roofline
    text = line(job, made_up_run(10, 5.0, peak), 9, monkeypatch, caplog)
    assert "500.0 ms/step  256 tokens/s  roofline 25%  peak mem 3.00 MiB" in text
    assert "left" not in text  # the last step


def test_log_every_is_checked():
    with pytest.raises(ConfigError, match="train.log_every"):
        resolve(build_job({"train": {"log_every": -1}}), 2)


def test_kernels_cached_reads_numbas_index_files(tmp_path, monkeypatch):
    (tmp_path / "fresh_kernels.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(_numba, "KERNEL_MODULES", ("fresh_kernels",))
    assert not _numba.kernels_cached()  # never compiled: the first step would compile it
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "fresh_kernels.gelu-12.py311.nbi").write_bytes(b"")
    assert _numba.kernels_cached()
