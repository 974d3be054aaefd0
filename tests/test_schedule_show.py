"""`schedule show` on big grids: bounded inputs (one line, exit 2, at once), summarised grids,
--all honouring --early-grad-send, and -v 0 refused rather than taken as 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mpihybrid.cli import main


def show(*args: str):
    return CliRunner().invoke(main, ["schedule", "show", *args])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--pp", "100000"], "--pp 100000"),
        (["--pp", "1000", "--microbatches", "1000"], "--pp 1000"),
        (["--pp", "200", "--microbatches", "1000"], "too big"),
        (["-v", "0", "--all"], "--virtual 0"),
        (["-v", "0", "--schedule", "interleaved-1f1b"], "--virtual 0"),
        (["--microbatches", "0"], "--microbatches 0"),
    ],
)
def test_out_of_range_is_one_line_and_exit_2_at_once(args, needle, monkeypatch):
    """Refused before anything is built or simulated (it was 48 s for 1000 x 1000, minutes for
    pp 100000): a call to the simulator fails the test."""
    import mpihybrid.pipeline.simulate as simulate

    def refuse(*_args, **_kwargs):
        raise AssertionError("the simulator ran on an out-of-range grid")

    monkeypatch.setattr(simulate, "describe", refuse)
    monkeypatch.setattr(simulate, "compare", refuse)
    result = show(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpihybrid: error:") and needle in lines[0]


def test_a_wide_long_grid_is_summarised():
    result = show("--pp", "20", "--microbatches", "40")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "rank 0" in lines[1] and "rank 19" in lines[1] and "rank 10" not in lines[1]
    assert "..." in lines[1] and any("steps left out" in line for line in lines)
    assert len(lines) < 80 and max(map(len, lines)) < 100
    full = show("--pp", "20", "--microbatches", "40", "--grid", "full").output.splitlines()
    assert "rank 10" in full[1] and len(full) > 100
    none = show("--pp", "20", "--microbatches", "40", "--grid", "none").output.splitlines()
    assert len(none) == 4 and none[1].startswith("bubble:")


def test_a_small_grid_is_shown_whole():
    result = show("--pp", "4", "--microbatches", "8")
    assert "..." not in result.output and "rank 3" in result.output


def test_all_honours_early_grad_send():
    plain, early = show("--all"), show("--all", "--early-grad-send")
    assert plain.exit_code == early.exit_code == 0
    assert "gradients sent before W" in early.output
    gpipe = [r for r in plain.output.splitlines() if r.startswith("gpipe")][0]
    gpipe_early = [r for r in early.output.splitlines() if r.startswith("gpipe")][0]
    # pp=4, m=8: the split backward lowers GPipe's simulated bubble from .273 to .200
    assert gpipe.split()[-4] == "0.273" and gpipe_early.split()[-4] == "0.200"
