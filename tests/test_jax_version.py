"""The supported jax range, checked at `import xlm` (xlm.jax_version)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from xlm.jax_version import SUPPORTED_TEXT, unsupported_reason


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2", "0.11.2", "0.11.9.dev20261101"])
def test_tested_versions_are_accepted(version):
    assert unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.9.2", "0.4.38", "0.12.0", "1.0.0"])
def test_other_versions_are_refused_with_the_range_and_what_to_install(version):
    reason = unsupported_reason(version)
    assert reason is not None
    assert f"found jax {version}" in reason and SUPPORTED_TEXT in reason
    assert "XLM_SKIP_JAX_VERSION_CHECK=1" in reason


def test_the_installed_jax_is_supported_and_declared_in_the_package():
    assert unsupported_reason(metadata.version("jax")) is None
    from packaging.requirements import Requirement

    declared = [Requirement(r) for r in metadata.requires("xlm")]
    (jax,) = [r for r in declared if r.name == "jax" and not r.marker]
    assert jax.specifier == Requirement(SUPPORTED_TEXT).specifier


_FAKE_JAX = """
import importlib.metadata as m, sys
real = m.version
m.version = lambda name: "0.12.1" if name == "jax" else real(name)
try:
    import xlm
except ImportError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize("skip", ["", "1"])
def test_import_xlm_stops_on_an_unsupported_jax_unless_told_to_skip(skip):
    env = {"XLM_SKIP_JAX_VERSION_CHECK": skip, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", _FAKE_JAX], capture_output=True, text=True, env=env, timeout=60
    )
    if skip:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 3 and "found jax 0.12.1" in out.stdout
