"""slurm/train.sbatch quotes what it passes on: a RUN_DIR holding a quote or a backslash stays
inside RUN_DIR, SET is split into words but never globbed, a non-TOML --set value is refused.
Runs the script with a stand-in launcher that prints the command line (no SLURM needed)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mpihybrid.config import ConfigError, parse_override
from tests.helpers import ROOT

LAUNCHER = '#!/usr/bin/env bash\nshift 2\nexec "$@"\n'  # `mpiexec -n N CMD...` -> CMD...
PYTHON = """#!/usr/bin/env bash
exec python3 -c 'import json, sys; print("ARGS " + json.dumps(sys.argv[1:]))' "$@"
"""


def submit(tmp_path, run_dir: str, set_value: str = "") -> tuple[subprocess.CompletedProcess, list]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("mpiexec", LAUNCHER), ("fakepython", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "matches-a-glob").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        SLURM_JOB_ID="42", SLURM_NTASKS="1", MPI_LAUNCH="mpiexec", PYTHON="fakepython",
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", RUN_DIR=run_dir, SET=set_value,
    )  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARGS ")]
    return proc, json.loads(lines[0][5:]) if lines else []


def overrides(args: list[str]) -> dict:
    found = {}
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--set":
            section, name, parsed = parse_override(value)
            found[f"{section}.{name}"] = parsed
    return found


@pytest.mark.parametrize("run_dir", ['runs/a"b', "runs/a\\b", 'runs/x"\\"y', "runs/it's"])
def test_a_run_dir_with_quotes_or_backslashes_stays_one_path(tmp_path, run_dir):
    proc, args = submit(tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    assert overrides(args)["checkpoint.dir"] == f"{run_dir}/ckpt"
    assert args[args.index("--trace") + 1] == f"{run_dir}/trace.h5"
    assert (tmp_path / run_dir).is_dir()


def test_a_run_dir_with_a_newline_is_refused_before_anything_is_made(tmp_path):
    proc, args = submit(tmp_path, "runs/a\nb")
    assert proc.returncode == 2 and "control character" in proc.stderr and not args
    assert not (tmp_path / "runs").exists()


def test_set_is_split_into_words_and_never_globbed(tmp_path):
    proc, args = submit(tmp_path, "runs/r", "train.steps=5  * comm.codec=int8")
    assert proc.returncode == 0, proc.stderr
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert sets[1:] == ["train.steps=5", "*", "comm.codec=int8"]  # not matches-a-glob


@pytest.mark.parametrize("value", ['"runs/a"b/ckpt"', "[1, 2", "'a'b'"])
def test_a_value_that_opens_toml_but_is_not_toml_is_refused(value):
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_override(f"checkpoint.dir={value}")
    assert parse_override("comm.codec=int8")[2] == "int8"  # a bare word stays a string
