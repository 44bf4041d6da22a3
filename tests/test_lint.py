"""The lint configuration in pyproject.toml ([tool.ruff]) is enforced, not only declared:
`ruff check` over the Python tree must pass (docs/conventions.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    pytest.importorskip("ruff", reason="ruff comes with the test extras")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "tools"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check failed:\n{r.stdout}\n{r.stderr}"
