"""The `mpihybrid` command (entry point mpihybrid.cli:main): commands, trace commands, bench,
sweep and its plots."""

from mpihybrid.cli.commands import main

__all__ = ["main"]
