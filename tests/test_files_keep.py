"""The last good state survives: checkpoint.keep keeps the best checkpoint too (a loss that
explodes but stays finite prunes nothing good), and an fp16 ring's overflow names its range."""

from __future__ import annotations

import json

import pytest

from mpihybrid.config import load_job
from mpihybrid.train import checkpoint
from mpihybrid.train.stops import TrainingStopped, stop_nonfinite


def checkpoints(root, losses_by_step: dict[int, list[float]]):
    for step, losses in losses_by_step.items():
        path = checkpoint.step_dir(root, step)
        path.mkdir(parents=True)
        manifest = {"format": checkpoint.FORMAT, "version": 2, "step": step, "losses": losses}
        (path / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint.complete(root)


def test_a_diverging_run_keeps_its_last_good_checkpoint(tmp_path, caplog):
    losses = [1.0, 0.8, 0.6, 0.5, 3.0, 40.0, 900.0, 1e5, 1e7]  # finite: no nan guard fires
    found = checkpoints(tmp_path, {s: losses[:s] for s in (2, 4, 6, 8, 9)})
    pruned = checkpoint.prunable(found, keep=3)
    assert [p.name for p in pruned] == ["step-000002"]  # step 4 (loss mean 0.725) stays
    assert "step-000004 is kept beyond checkpoint.keep = 3" in caplog.text


def test_a_converging_run_keeps_the_newest(tmp_path):
    found = checkpoints(tmp_path, {s: [1.0 / (i + 1) for i in range(s)] for s in range(1, 7)})
    assert [p.name for p in checkpoint.prunable(found, keep=2)] == [
        f"step-00000{s}" for s in range(1, 5)
    ]


def test_unreadable_or_nan_checkpoints_are_never_the_best(tmp_path):
    found = checkpoints(tmp_path, {1: [0.1], 2: [float("nan")], 3: [0.5], 4: [0.6]})
    (found[0] / "manifest.json").write_text("{torn")
    assert [p.name for p in checkpoint.prunable(found, keep=1)] == ["step-000001", "step-000002"]


class World:
    def allgather(self, value):
        return [value]


@pytest.mark.parametrize("codec, hint", [("fp16", True), ("bf16", False), ("int8", False)])
def test_a_nonfinite_gradient_after_an_fp16_ring_names_its_range(codec, hint):
    job = load_job(None, [f"comm.codec={codec}"], 2)
    with pytest.raises(TrainingStopped) as err:
        stop_nonfinite(World(), job, 4, 1.5, [0])
    message = str(err.value)
    assert message.startswith("step 5: the gradient of stage 0 is not finite")
    assert ("65504" in message and "comm.codec=bf16" in message) == hint, message
