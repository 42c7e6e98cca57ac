"""The multihost executor's process bookkeeping: which id a process has, where the leader's
step channel listens, who follows, and stdout kept for Python (the executor itself runs
in tests/e2e/test_multihost_runs.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xlm import envs
from xlm.config import ParallelConfig
from xlm.executor.multihost import channel_address, is_follower, resolve_process_id


@pytest.fixture
def no_pod(monkeypatch):
    for name in (*envs.POD_VARIABLES, "XLM_PROCESS_ID", "XLM_MULTIHOST_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _multihost(**fields) -> ParallelConfig:
    fields.setdefault("coordinator_address", "10.0.0.5:1234")
    return ParallelConfig(executor_backend="multihost", num_processes=4, **fields)


def test_process_id_from_the_option_then_xlm_then_the_pod(no_pod):
    assert resolve_process_id(_multihost()) is None
    no_pod.setenv("TPU_WORKER_ID", "3")
    assert resolve_process_id(_multihost()) == 3
    no_pod.setenv("XLM_PROCESS_ID", "2")
    assert resolve_process_id(_multihost()) == 2
    assert resolve_process_id(_multihost(process_id=0)) == 0


def test_step_channel_is_the_coordinators_host_at_the_next_port(no_pod):
    assert channel_address(_multihost()) == ("10.0.0.5", 1235)
    assert channel_address(_multihost(coordinator_address="[fd00::1]:80")) == ("[fd00::1]", 81)
    no_pod.setenv("XLM_MULTIHOST_PORT", "7000")
    assert channel_address(_multihost()) == ("10.0.0.5", 7000)


def test_channel_without_any_coordinator_names_the_option(no_pod):
    from jax._src import distributed

    if distributed.global_state.coordinator_address:
        pytest.skip("this process joined a jax.distributed group")
    with pytest.raises(ValueError, match="coordinator_address=None.*--coordinator-address"):
        channel_address(_multihost(coordinator_address=None))


def test_only_a_multihost_process_other_than_0_follows(no_pod):
    assert not is_follower(ParallelConfig(process_id=None))  # the uni backend
    assert not is_follower(_multihost(process_id=0))
    assert is_follower(_multihost(process_id=1)) and is_follower(_multihost(process_id=3))
    with pytest.raises(ValueError, match="process_id=None: multihost needs each process's id"):
        is_follower(_multihost())


def test_native_writes_to_stdout_go_to_stderr_and_python_keeps_stdout():
    script = (
        "import os, sys\n"
        "from xlm.executor.multihost import keep_stdout_for_python\n"
        "print('before', flush=True)\n"
        "keep_stdout_for_python(); keep_stdout_for_python()\n"
        "os.write(1, b'native line\\n')\n"
        "print('after')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == "before\nafter\n"
    assert "native line" in done.stderr
