"""Helpers of the CPU kernel tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose kernel library is built at run time into
    `tmp_path`'s cache (XLM_CPU_KERNELS_PREBUILT=0: the runtime build is under test, not a
    library an install left in the tree), with `env` on top."""
    environ = {
        **os.environ,
        "XLM_CACHE_ROOT": str(tmp_path / "cache"),
        "XLM_CPU_KERNELS_PREBUILT": "0",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
