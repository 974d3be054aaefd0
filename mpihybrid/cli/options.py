"""Options several commands share, declared once.

@click.command()
@set_option()                        # --set SECTION.KEY=VALUE (repeatable) -> overrides
def train(*, overrides, ...): ...
"""

from __future__ import annotations

import click


def set_option(example: str = "train.steps=20", of: str = "job setting"):
    """`--set SECTION.KEY=VALUE`, repeatable, into the command's `overrides` (config.build_job
    applies them over the job file)."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help=f"Override one {of} (repeatable), e.g. --set {example}.",
    )
