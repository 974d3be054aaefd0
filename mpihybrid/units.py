"""Numbers for people: byte counts and rates as text (reports, analysis tables, benchmarks)."""

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
