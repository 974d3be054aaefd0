"""The evaluation's pieces are sized by memory, not by the training micro-batch (issue 53): a
wide MLP's final evaluation ran thousands of micro-batch pieces (15 % slower for the whole run);
a piece's activations stay within EVAL_BYTES and its logits within EVAL_LOGITS."""

from __future__ import annotations

import pytest

from mpihybrid.config import load_job
from mpihybrid.nn.cost import stage_work
from mpihybrid.train.evaluate import EVAL_BYTES, EVAL_LOGITS, eval_pieces


@pytest.mark.parametrize(
    "settings",
    [["model.hidden=1024", "data.test_samples=60000"], ["model.kind=gpt", "data.kind=markov"],
     ["model.hidden=16"]],
    ids=["wide-mlp", "gpt", "narrow-mlp"],
)  # fmt: skip
def test_pieces_are_sized_by_memory(settings):
    job = load_job(None, settings, 2)
    classes, tokens = 10, job.tokens_per_sample
    rows = eval_pieces(job, 30000, classes, tokens)
    per_sample = max(c.activation_bytes for c in stage_work(job.workload)) / job.microbatch_size
    assert rows * per_sample <= EVAL_BYTES and rows * tokens * classes <= EVAL_LOGITS
    fuller = (rows + 1) * per_sample > EVAL_BYTES or (rows + 1) * tokens * classes > EVAL_LOGITS
    assert rows == 30000 or fuller  # all the rows, or as many as the bounds allow
    if "model.hidden=1024" in settings:
        assert rows > 100 * job.microbatch_size  # not the training micro-batch's 8


def test_a_piece_is_never_more_than_the_rows_nor_less_than_one():
    job = load_job(None, ["model.hidden=1024"], 2)
    assert eval_pieces(job, 5, 10, 1) == 5
    assert eval_pieces(job, 30000, 1 << 30, 1) == 1
