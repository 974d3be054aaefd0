"""Progress lines: rank 0's stderr unless --quiet; never stdout, never another rank."""

from __future__ import annotations

import click
from click.testing import CliRunner

from mpihybrid.cli import progress


def test_progress_goes_to_rank_0s_stderr_unless_quiet():
    @click.command()
    @click.option("--rank", type=int, default=0)
    @click.option("--quiet", is_flag=True)
    def run(rank, quiet):
        progress.progress_echo(rank, quiet)("[1/3] repeat 1")
        click.echo("result")

    for args, err in (([], "[1/3] repeat 1\n"), (["--quiet"], ""), (["--rank", "1"], "")):
        result = CliRunner().invoke(run, args)
        assert result.stdout == "result\n" and result.stderr == err, args
