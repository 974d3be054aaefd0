"""Progress lines: rank 0, on a terminal, not --quiet; nothing otherwise."""

from __future__ import annotations

import io

from mpihybrid.cli import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_from_rank_0_without_quiet(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(progress.sys, "stderr", terminal)
    progress.progress_echo(0, quiet=False)("[1/3] repeat 1")
    progress.progress_echo(0, quiet=True)("quiet")
    progress.progress_echo(1, quiet=False)("rank 1")
    assert terminal.getvalue() == "[1/3] repeat 1\n"
    pipe = io.StringIO()  # isatty() is False: a pipe, a batch log
    monkeypatch.setattr(progress.sys, "stderr", pipe)
    monkeypatch.setattr(progress, "LAUNCHERS", ("no-such-launcher",))
    progress.progress_echo(0, quiet=False)("piped")
    assert pipe.getvalue() == ""
