"""Numbers for people: byte counts and rates as text, and the one way the CLI prints a table."""

from __future__ import annotations


def human_bytes(n: float, digits: int = 2) -> str:
    """1536 -> "1.50 KiB" (`digits` decimals); whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"  # pragma: no cover


def human_rate(bytes_per_s: float | None) -> str:
    """Bytes per second in decimal units, as bandwidth is quoted ("12.5 GB/s"); "-" for None."""
    if bytes_per_s is None:
        return "-"
    for unit in ("B/s", "KB/s", "MB/s", "GB/s"):
        if bytes_per_s < 1000 or unit == "GB/s":
            return f"{bytes_per_s:.1f} {unit}"
        bytes_per_s /= 1000
    return "-"  # pragma: no cover


def table(
    header: list[str], rows: list[list[str]], labels: int = 1, left: tuple[int, ...] = ()
) -> list[str]:
    """An aligned text table, the only one the CLI prints (analyze, compare, bench, sweep,
    predict): the first `labels` columns (and those numbered in `left`) left-aligned, the
    numbers right-aligned, dashes under the header."""
    header = [str(c) for c in header]
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < labels or i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
