"""Whether a traced run had more ranks on a node than cores (its times then measure the machine),
from the trace's hostnames and core counts, and the caveat analyze and timeline print.
"""

from __future__ import annotations


def oversubscription(attrs: dict) -> dict | None:
    """The host with the most ranks per core when it has more ranks than cores, from the trace's
    hostnames and host_cores; None when no host is oversubscribed or the trace does not say."""
    hosts, cores = attrs.get("hostnames"), attrs.get("host_cores")
    if not hosts or not cores or len(hosts) != len(cores):
        return None
    ranks: dict[str, int] = {}
    for host in hosts:
        ranks[str(host)] = ranks.get(str(host), 0) + 1
    n_cores = {str(h): int(c) for h, c in zip(hosts, cores, strict=True)}
    worst = max(ranks, key=lambda h: ranks[h] / max(n_cores[h], 1))
    if ranks[worst] <= n_cores[worst]:
        return None
    return {"host": worst, "ranks": ranks[worst], "cores": n_cores[worst]}


def oversubscription_text(over: dict | None) -> str | None:
    """The one-line caveat under every figure of an oversubscribed run."""
    if over is None:
        return None
    return (
        f"oversubscribed: {over['ranks']} ranks on {over['cores']} cores of {over['host']}: "
        "ranks waited for a core, so times and bubbles measure the machine, not the schedule"
    )
