"""docs/trace-format.md against the writer: a fresh trace has every documented root attribute with
its documented type, every attribute it has is documented, and the event columns, kinds and
/steps datasets are the documented ones."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from mpihybrid.sysinfo import LIMIT
from mpihybrid.trace.read import SCHEMA_VERSION, load
from mpihybrid.trace.recorder import EVENT_DTYPE, KINDS
from tests.helpers import ROOT, flavour, run_mpi

DOC = (ROOT / "docs" / "trace-format.md").read_text()
PYTHON_TYPES = {"string": str, "int": int, "float": float, "bool": bool}


def section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end >= 0 else None]


def rows(title: str) -> list[list[str]]:
    """The table rows of a section whose first cell is a `name`, split into stripped cells."""
    out = []
    for line in section(title).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"`[^`]+`", cells[0]):
            out.append(cells)
    return out


def documented_attrs() -> dict[str, tuple[str, bool]]:
    """name -> (type word, optional)."""
    out = {}
    for cells in rows("Root attributes"):
        kind = cells[1]
        out[cells[0].strip("`")] = (kind.replace("(optional)", "").strip(), "optional" in kind)
    return out


def test_the_doc_names_this_schema_version():
    assert f"schema version {SCHEMA_VERSION})" in DOC.splitlines()[0]


def test_event_columns_and_kinds_are_the_documented_ones():
    columns = {c[0].strip("`"): c[1] for c in rows("`/events`")}
    assert list(columns) == list(EVENT_DTYPE.names)
    for name, kind in columns.items():
        assert np.dtype(kind).newbyteorder("<") == EVENT_DTYPE[name].newbyteorder("<"), name
    assert f"{EVENT_DTYPE.itemsize} bytes per row" in DOC
    kinds = re.findall(r"^\| (\d+)\s+\| `(\w+)`", section("`/events`"), re.M)
    assert [(int(code), name) for code, name in kinds] == list(enumerate(KINDS))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc") / "run.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", "--trace", str(path),
                   "--set", "train.steps=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with h5py.File(path) as f:  # the one attribute load() consumes
        names = [str(n) for n in f.attrs["json_attrs"]]
        assert names == [
            "hostnames", "host_cores", "peak_rss_bytes", "core_probe_s", "row_probe_rows",
            "row_probe_s",
        ]  # fmt: skip
    return load(path)


@pytest.mark.mpi
def test_every_documented_attribute_is_written_with_its_type(fresh):
    for name, (kind, _optional) in documented_attrs().items():
        if name in ("stopped_at_step", "json_attrs", "schedule_csv"):
            # after a preemption only (tests/test_trace_stream.py); read by load(); csv: runs
            # only (tests/test_csv_schedules.py)
            continue
        assert name in fresh.attrs, name  # a finished run has the optional ones too
        value = fresh.attrs[name]
        if kind == "int array":
            assert isinstance(value, np.ndarray) and value.dtype.kind == "i", name
        elif kind.startswith("list of "):
            want = {"list of strings": str, "list of ints": int, "list of floats": float}[kind]
            assert isinstance(value, list) and all(isinstance(v, want) for v in value), name
        else:
            want = PYTHON_TYPES[kind]
            assert isinstance(value, want) and (want is bool or not isinstance(value, bool)), name
    assert len(fresh.attrs["hostnames"]) == fresh.attrs["world_size"]  # one per rank
    assert len(fresh.attrs["peak_rss_bytes"]) == fresh.attrs["world_size"]
    assert len(fresh.attrs["core_probe_s"]) == fresh.attrs["world_size"]
    assert len(fresh.attrs["host_cores"]) == fresh.attrs["world_size"]
    assert len(fresh.attrs["row_probe_s"]) == 6 * fresh.attrs["pp"] * fresh.attrs["virtual_stages"]


@pytest.mark.mpi
def test_every_written_attribute_and_dataset_is_documented(fresh):
    documented = documented_attrs()
    assert set(fresh.attrs) | {"json_attrs"} <= set(documented)
    steps = {c[0].strip("`"): c[1] for c in rows("`/steps`")}
    # grad_norm is written with train.grad_clip > 0 only (tests/test_clip.py)
    assert set(fresh.steps) == set(steps) - {"grad_norm"}
    for name, kind in steps.items():
        if name in fresh.steps:
            assert fresh.steps[name].dtype == np.dtype(kind), name


@pytest.mark.mpi
def test_what_mpi_and_the_host_said_is_written_clean(fresh):
    # Open MPI's library version ends in NUL bytes, which HDF5 refused: every traced run failed
    library = fresh.attrs["mpi_library"]
    print(f"{flavour()}: mpi_library = {library!r}")
    assert 0 < len(library) <= LIMIT and library.isprintable(), library
    if flavour() != "unknown":  # the library mpi4py was built against is the launcher's
        assert library.startswith(flavour()), (flavour(), library)
    for name in fresh.attrs["hostnames"]:
        assert 0 < len(name) <= LIMIT and name.isprintable(), name
    assert fresh.attrs["command"].isprintable()
