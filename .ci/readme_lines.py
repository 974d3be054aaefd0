"""The README's two set-up lines, read out of its quick-start block: what .ci/run runs, verbatim.

    python3 .ci/readme_lines.py [README.md]     # prints the train line, then the test line

The block is the first ``` fence after the '## Quick start' heading; it must hold exactly two
lines, the first training with `mpihybrid train`, the second running `pytest`. Anything else is
one line on stderr and exit 1, so CI fails at once rather than running something else.
"""

from __future__ import annotations

import sys
from pathlib import Path


def readme_lines(text: str) -> tuple[str, str]:
    lines = text.splitlines()
    try:
        start = lines.index("## Quick start")
        fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
        end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    except (ValueError, StopIteration):
        raise ValueError("no ``` block under '## Quick start'") from None
    block = [line for line in lines[fence + 1 : end] if line.strip()]
    if len(block) != 2:
        raise ValueError(f"the quick-start block holds {len(block)} lines, not 2")
    train, test = block
    if "mpihybrid train" not in train or "pytest" not in test:
        raise ValueError("the quick-start block's lines are not (train, test)")
    return train, test


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    try:
        print("\n".join(readme_lines(path.read_text())))
    except (OSError, ValueError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        sys.exit(1)
