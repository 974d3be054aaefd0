"""The README's two set-up lines are what CI runs (.ci/readme_lines.py reads them), they install
every extra the documented features and the suite use, and a missing extra skips its tests
rather than stopping the collection."""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("readme_lines", ROOT / ".ci" / "readme_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extras(line: str) -> set[str]:
    found = re.search(r'pip install "\.\[([a-z,]+)\]"', line)
    assert found, line
    return set(found.group(1).split(","))


def test_the_two_lines_install_every_extra_the_suite_and_features_use():
    train, test = _module().readme_lines((ROOT / "README.md").read_text())
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    every = set(cfg["options.extras_require"]) - {"cuda"}  # cuda: a GPU's own CuPy wheel
    assert _extras(test) == every
    assert _extras(train) == every - {"test"}
    assert test.endswith("python -m pytest -q")


@pytest.mark.parametrize(
    "text, says",
    [
        ("# mpihybrid\n\nno quick start\n", "no ``` block"),
        ("## Quick start\n\n```\nmpiexec -n 4 mpihybrid train\n```\n", "holds 1 lines"),
        ("## Quick start\n\n```\npip install a\npython -m pytest\n```\n", "not (train, test)"),
    ],
)
def test_a_readme_without_the_block_is_one_line(tmp_path, text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        _module().readme_lines(text)
    (tmp_path / "README.md").write_text(text)
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_lines.py"), str(tmp_path / "README.md")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr


def test_a_missing_extra_skips_its_tests_and_never_stops_the_collection(tmp_path):
    # sys.modules[name] = None is how Python spells "not installed" to import and find_spec alike
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('safetensors', 'ortools', 'tokenizers', 'matplotlib', 'numba', 'torch'):\n"
        "    sys.modules[name] = None\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
         str(ROOT / "tests")],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.splitlines()[-1]
    assert "safetensors is not installed (the weights extra)" in proc.stdout
