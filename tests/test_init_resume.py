"""A run started from model.init resumes from its checkpoint without the file (issue 53), a
mismatch names the differing key once, a file with a NaN is refused naming the tensor, and a
checkpoint under another placement's chunks is refused naming both and the way across."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors is not installed (the weights extra)")
from safetensors.numpy import save_file  # noqa: E402

from mpihybrid.cli.run import _preflight  # noqa: E402
from mpihybrid.config import ConfigError  # noqa: E402
from mpihybrid.nn import weights as nw  # noqa: E402
from mpihybrid.train.checkpoint import CheckpointError, check_compatible  # noqa: E402
from tests.helpers import run_mpi  # noqa: E402
from tests.test_weights import TINY, job, stages  # noqa: E402

ARGV = ["--quiet", *(a for s in TINY for a in ("--set", s))]


def _init_file(tmp_path, poison: str = ""):
    tensors = nw.export_tensors(stages(job(), 1, 0), 5)
    if poison:
        tensors[poison].flat[0] = np.nan
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.mpi
def test_a_run_from_init_resumes_without_the_file(tmp_path):
    path, ckpt = _init_file(tmp_path), tmp_path / "ckpt"

    def train(steps, *more):
        return run_mpi(1, "-m", "mpihybrid", "train", *ARGV, "--set", f"train.steps={steps}",
                       "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=2", *more,
                       cwd=tmp_path)  # fmt: skip

    first = train(2, "--set", f"model.init={path.name}")
    assert first.returncode == 0, first.stderr
    path.rename(tmp_path / "moved.safetensors")
    again = train(4, "--resume", "--set", f"model.init=./{path.name}")  # gone, spelled otherwise
    assert again.returncode == 0, again.stderr
    assert "is not read: the run resumes from the weights" in again.stdout + again.stderr
    plain = train(6, "--resume")  # the setting left out
    assert plain.returncode == 0, plain.stderr
    other = train(8, "--resume", "--set", "model.ffn=64")
    assert other.returncode == 2
    (line,) = [x for x in other.stderr.splitlines() if "error" in x]
    assert "has model.ffn = 32 but this job has 64" in line and "{" not in line, line


def test_a_nonfinite_init_file_is_refused_naming_the_tensor(tmp_path):
    path = _init_file(tmp_path, poison="transformer.h.1.mlp.c_fc.weight")
    with pytest.raises(ConfigError, match=r"transformer.h.1.mlp.c_fc.weight holds 1 non-finite"):
        _preflight(job(f"model.init={path}"), resume=False)


def test_another_placements_checkpoint_names_both_and_the_way_across(tmp_path):
    j = job("grid.pp=2", "train.schedule=zb-v", world=2)
    manifest = {"pp": 2, "virtual_stages": 1}
    with pytest.raises(CheckpointError) as err:
        check_compatible(manifest, j, tmp_path / "ckpt" / "step-000002")
    says = str(err.value)
    assert "pp = 2 x 1" in says and "zb-v at pp = 2 x 2" in says, says
    assert "weights export" in says and "model.init" in says
