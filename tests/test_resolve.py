"""The one resolution (cli/resolve.py): every command that runs or predicts a job takes it from
there, and no other command module loads a job by itself."""

from __future__ import annotations

import ast

import pytest

from mpihybrid.cli.resolve import job_path, resolve_offline
from mpihybrid.config import ConfigError
from tests.helpers import ROOT

CLI = ROOT / "mpihybrid" / "cli"
RESOLUTION = {"resolve_job", "rewrite", "resolve_offline"}
# (module, the function a command's job passes through)
ENTRIES = [
    ("run.py", "train"),
    ("bench_commands.py", "bench_train"),
    ("sweep.py", "_prepare"),
    ("predict.py", "_load_job"),
    ("schedule_search.py", "search_job"),
]
# the modules that may still call config.load_job, and why
LOADS_A_JOB = {
    "resolve.py": "the resolution itself",
    "sweep.py": "a plan's template; each cell it runs goes through resolve.rewrite",
    "bench_blas.py": "the GEMM shapes of a job; nothing of it runs",
    "sweep_plan.py": "a cell validated for the world; sweep.py then rewrites it (resolve.rewrite)",
}


def _calls(node: ast.AST) -> set[str]:
    """The names of the functions called by name (`resolve(...)`, not `path.resolve()`)."""
    return {
        n.func.id
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }


def _function(module: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((CLI / module).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"cli/{module} has no function {name}"
    return found[0]


@pytest.mark.parametrize("module, name", ENTRIES)
def test_every_commands_job_comes_from_the_one_resolution(module, name):
    assert _calls(_function(module, name)) & RESOLUTION, f"cli/{module}:{name} resolves by itself"


def test_no_other_command_loads_a_job_by_itself():
    wrong = [
        p.name
        for p in sorted(CLI.glob("*.py"))
        if p.name not in LOADS_A_JOB and {"load_job", "resolve"} & _calls(ast.parse(p.read_text()))
    ]
    assert not wrong, f"these call config.load_job / config.resolve themselves: {wrong}"


def test_offline_resolution_takes_a_packaged_job_by_name_and_refuses_dp_minus_one():
    assert job_path("gpt_bench").endswith("jobs/gpt_bench.toml")
    job = resolve_offline("gpt_bench", ["grid.dp=1", "train.steps=1"])
    assert job.grid.pp == 2 and job.train.steps == 1
    with pytest.raises(ValueError, match="grid.dp = -1 takes the world size"):
        resolve_offline("jobs/gpt_bench.toml", ["grid.dp=-1"])
    with pytest.raises(ConfigError, match="unknown key"):
        resolve_offline("jobs/gpt_bench.toml", ["train.nope=1"])
