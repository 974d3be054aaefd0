"""What MPI and the host say is cleaned before a file holds it (mpihybrid/sysinfo.py)."""

from __future__ import annotations

import h5py
import pytest

from mpihybrid.sysinfo import LIMIT, clean_text

OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"


def printable(text: str) -> bool:
    return all(ch.isprintable() for ch in text)


@pytest.mark.parametrize(
    "raw, want",
    [
        (OPEN_MPI + "\x00", OPEN_MPI),  # Open MPI's Get_library_version() ends in a NUL
        (OPEN_MPI + "\x00" * 200 + "garbage", OPEN_MPI + " garbage"),
        ("MPICH Version:\t4.2\nMPICH Release date: x", "MPICH Version: 4.2 MPICH Release date: x"),
        ("node\x1b[31m-1\x7f\x9b", "node [31m-1"),  # an escape sequence cannot reach a terminal
        ("a\udcffb", "a\ufffdb"),  # a byte that was not UTF-8 (surrogateescape)
        (b"host\xff\x00", "host\ufffd"),
        ("\x00\x00\x00", ""),
        ("plain", "plain"),
    ],
)  # fmt: skip
def test_control_characters_and_bad_bytes_are_cleaned(raw, want):
    assert clean_text(raw) == want


@pytest.mark.parametrize("size", [LIMIT + 1, 10**7])
def test_a_huge_string_is_bounded_and_says_so(size):
    line = clean_text("x" * size)
    assert len(line) == LIMIT and line.endswith("...")


def test_a_huge_string_is_cut_before_it_is_scanned():
    assert clean_text("\x00" * 10**8) == "..."  # what was cut away is said, even if only NULs
    assert clean_text("\x00" * 1000) == ""
    assert clean_text("y" * 5000, limit=4096) == "y" * 4093 + "..."


def test_a_string_at_the_limit_is_kept_whole():
    assert clean_text("z" * LIMIT) == "z" * LIMIT


def test_what_is_cleaned_is_written_by_hdf5(tmp_path):
    # what failed every traced run on Open MPI: HDF5 refuses a string with a NUL in it
    with h5py.File(tmp_path / "a.h5", "w") as f:
        with pytest.raises(ValueError, match="NUL"):
            f.attrs["mpi_library"] = OPEN_MPI + "\x00"
        for raw in (OPEN_MPI + "\x00", "a\udcffb", "\x00" * 10**6):
            f.attrs["mpi_library"] = clean_text(raw)
            assert f.attrs["mpi_library"] == clean_text(raw) and printable(clean_text(raw))
