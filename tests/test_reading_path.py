"""docs/reading.md names the files of a step's path with their sizes: every file exists, its
stated line count is within 15 % (or 20 lines) of the file's own, and the README points to it."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def test_the_reading_path_names_real_files_at_their_sizes():
    rows = re.findall(
        r"^\| `([^`]+)` \| (\d+) \|", (ROOT / "docs" / "reading.md").read_text(), re.M
    )
    assert len(rows) >= 10
    wrong = []
    for path, stated in rows:
        file = ROOT / path
        assert file.is_file(), f"docs/reading.md names {path}, which is not there"
        lines = len(file.read_text().splitlines())
        if abs(lines - int(stated)) > max(20, 0.15 * lines):
            wrong.append(f"{path}: {stated} stated, {lines} now")
    assert not wrong, "docs/reading.md's line counts are stale:\n" + "\n".join(wrong)


def test_the_readme_points_to_the_reading_path():
    assert "docs/reading.md" in (ROOT / "README.md").read_text()
