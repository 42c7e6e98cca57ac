"""`.ci/run` passes only when pytest ran tests and they passed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parents[2] / ".ci" / "run"


def _run_with_pytest_exit(tmp_path: Path, pytest_rc: int) -> subprocess.CompletedProcess:
    """Run .ci/run with pip/ruff/python stand-ins on PATH; python exits pytest_rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, rc in (("pip", 0), ("ruff", 0), ("python", pytest_rc)):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\nexit {rc}\n")
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin")
    return subprocess.run(["bash", str(CI_RUN)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("pytest_rc, expected", [(0, 0), (1, 1), (5, 5)])
def test_ci_run_exit_code_follows_pytest(tmp_path, pytest_rc, expected):
    proc = _run_with_pytest_exit(tmp_path, pytest_rc)
    assert proc.returncode == expected, proc.stdout + proc.stderr
    if pytest_rc == 5:
        assert "collected no tests" in proc.stderr
