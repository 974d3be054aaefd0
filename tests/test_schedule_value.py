"""The schedule as one value (pipeline/plan.py): made once for a resolved job and read by its
consumers; only pipeline/ turns a name into lists; a searched schedule travels with its job,
not through a registry of the process."""

from __future__ import annotations

import ast
import json

import pytest

from mpihybrid.config import job as job_module
from mpihybrid.config import load_job
from mpihybrid.config.searched import apply
from mpihybrid.pipeline.csv_schedule import dump_csv
from mpihybrid.pipeline.plan import make_schedule
from mpihybrid.pipeline.schedules import ScheduleError, get_spec
from mpihybrid.pipeline.simulate import simulate, unit_costs
from tests.helpers import ROOT

PACKAGE = ROOT / "mpihybrid"
NAME_TO_LISTS = {"placement_of", "build_schedule"}


def _called(tree: ast.AST) -> set[str]:
    """The functions of NAME_TO_LISTS a module calls or imports."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found |= {a.name for a in node.names} & NAME_TO_LISTS
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            found |= {name} & NAME_TO_LISTS
    return found


def test_only_pipeline_turns_a_schedule_name_into_lists():
    """placement_of and build_schedule are called where the value is made (pipeline/plan.py)
    and inside pipeline/; everything else reads a Schedule (Job.schedule, make_schedule)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "pipeline") in path.parents:
            continue
        if called := _called(ast.parse(path.read_text())):
            wrong.append(f"{path.relative_to(ROOT)}: {', '.join(sorted(called))}")
    assert not wrong, "a schedule's name turned into lists outside pipeline/:\n" + "\n".join(wrong)
    # the check sees a call
    assert _called(ast.parse("from x import placement_of\ns.build_schedule(1)")) == NAME_TO_LISTS


def test_a_resolved_jobs_schedule_is_made_once_for_all_its_readers(monkeypatch):
    from mpihybrid.predict.wire import job_placement
    from mpihybrid.train.memory import rank_estimate
    from mpihybrid.train.tracing import layout_attrs

    made = []
    real = job_module.make_schedule
    monkeypatch.setattr(
        job_module, "make_schedule", lambda *a, **k: made.append(a) or real(*a, **k)
    )
    job = load_job(None, ["grid.pp=2", "train.schedule=zb-v", "train.microbatches=4"], 2)
    attrs = layout_attrs(job, 2)
    assert job_placement(job) is job.schedule.placement
    estimates = [rank_estimate(job, r) for r in range(2)]
    assert len(made) == 1 and all(e["activations"] > 0 for e in estimates)
    assert list(attrs["stage_ranks"]) == [0, 1, 1, 0]  # a V: rank 0 holds stages 0 and 3
    lists = job.schedule.lists()
    lists[0].clear()  # the caller's own copy: the value stays as made
    assert (
        job.schedule.compute[0]
        and job.schedule.lists() == make_schedule("zb-v", 2, 4, 2, early_grad_send=True).lists()
    )


def test_a_searched_schedule_travels_with_its_job_not_the_process():
    job = load_job(None, ["grid.pp=2", "train.microbatches=4", "model.depth=6"], 2)
    found = make_schedule("zb-v", 2, 4, 2)
    text = dump_csv(found.lists(), simulate(found.lists(), found.placement,
                                            unit_costs(found.lists())).start)  # fmt: skip
    record = json.dumps({"placement": "v", "found_by": "zb-v"})
    payload = {"csv": text, "partition": [2, 1, 1, 2], "chunks": 2, "info": record}
    searched = apply(job, payload, 2)
    name = searched.train.schedule
    assert name.startswith("csv:auto@") and searched.model.partition == [2, 1, 1, 2]
    ran = searched.schedule
    assert (ran.csv, ran.search, ran.placement) == (text, record, found.placement)
    assert ran.lists() == found.lists()
    with pytest.raises(ScheduleError, match="cannot read it"):
        get_spec(name)  # no registry: the name alone is no schedule in this process
    with pytest.raises(ScheduleError, match="searched before"):
        _ = load_job(None, ["grid.pp=2", "train.schedule=auto"], 2).schedule
