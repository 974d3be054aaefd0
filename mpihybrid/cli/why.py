"""`mpihybrid why RUN`: where every rank was when a run ended abnormally (its flight records).

mpihybrid why runs/seed.h5          # reads runs/seed.flight/rank*.h5
mpihybrid why runs/seed.flight
"""

from __future__ import annotations

import json
import sys

import click


@click.command()
@click.argument("run", metavar="RUN.h5|FLIGHT_DIR")
@click.option("--json", "as_json", is_flag=True, help="Every rank's record as JSON.")
def why(run: str, as_json: bool) -> None:
    """Name the rank and action a run stopped at and what each other rank waited for.

    Every rank writes its last actions and waits (a flight record) beside the trace when the run
    ends abnormally: the watchdog (comm.timeout_s), a signal, or an error. Records of an
    earlier run left in the same place are left out (said in one line); what is printed is
    bounded whatever the files claim."""
    from mpihybrid.train.explain import explain, read_records, trace_hosts
    from mpihybrid.train.flight import describe

    try:
        directory, records, notes = read_records(run)
    except ValueError as exc:
        click.echo(f"mpihybrid: error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        out = {
            str(rank): {
                "attrs": {k: (v.item() if hasattr(v, "item") else v) for k, v in attrs.items()},
                "notes": notes,
                "rows": [
                    describe(row) + ("" if row["end"] == row["end"] else " (running)")
                    for row in rows
                ],
            }
            for rank, (attrs, rows) in sorted(records.items())
        }
        click.echo(json.dumps(out, indent=2, default=str))
        return
    click.echo(f"{directory}:")
    for line in notes + explain(records, trace_hosts(run)):
        click.echo(line)
