"""xlm.envs: variables read at access time, typed, with errors naming the variable."""

from __future__ import annotations

import os

import pytest

from xlm import envs


def test_values_follow_the_environment_at_access_time(monkeypatch):
    monkeypatch.setenv("XLM_PLUGINS", " a, ,b ")
    assert envs.XLM_PLUGINS == ["a", "b"]
    monkeypatch.setenv("XLM_PLUGINS", "")
    assert envs.XLM_PLUGINS == []  # empty loads none
    monkeypatch.delenv("XLM_PLUGINS")
    assert envs.XLM_PLUGINS is None  # unset loads all


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("no", False)],
)
def test_booleans(monkeypatch, value, expected):
    monkeypatch.setenv("XLM_DISABLE_PROGRESS_BARS", value)
    assert envs.XLM_DISABLE_PROGRESS_BARS is expected


def test_defaults_when_unset_or_empty(monkeypatch):
    monkeypatch.setenv("XLM_CPU_KERNELS", "")
    assert envs.XLM_CPU_KERNELS is True
    monkeypatch.delenv("XLM_LOG_STATS_INTERVAL", raising=False)
    assert envs.XLM_LOG_STATS_INTERVAL == 10.0
    monkeypatch.setenv("XLM_LOGGING_LEVEL", "debug")
    assert envs.XLM_LOGGING_LEVEL == "DEBUG"


def test_cache_dirs_follow_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("XLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("XLM_COMPILATION_CACHE_DIR", raising=False)
    assert envs.XLM_COMPILATION_CACHE_DIR == str(tmp_path / "compiled_programs")
    monkeypatch.delenv("XLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.XLM_CACHE_ROOT == str(tmp_path / "xdg" / "xlm")


def test_bad_numbers_name_the_variable(monkeypatch):
    monkeypatch.setenv("XLM_ENGINE_READY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="XLM_ENGINE_READY_TIMEOUT_S='soon' is not a number"):
        getattr(envs, "XLM_ENGINE_READY_TIMEOUT_S")  # noqa: B009 (read for its error)
    monkeypatch.setenv("XLM_NUM_PROCESSES", "2.5")
    with pytest.raises(ValueError, match="XLM_NUM_PROCESSES='2.5' is not an integer"):
        getattr(envs, "XLM_NUM_PROCESSES")  # noqa: B009 (read for its error)
    monkeypatch.setenv("XLM_NUM_PROCESSES", "4")
    assert envs.XLM_NUM_PROCESSES == 4


def test_tpu_worker_id_prefers_tpu_worker_id(monkeypatch):
    monkeypatch.delenv("TPU_WORKER_ID", raising=False)
    monkeypatch.delenv("CLOUD_TPU_TASK_ID", raising=False)
    assert envs.tpu_worker_id() is None
    monkeypatch.setenv("CLOUD_TPU_TASK_ID", "3")
    assert envs.tpu_worker_id() == 3
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert envs.tpu_worker_id() == 1


def test_unknown_names_are_refused(monkeypatch):
    with pytest.raises(AttributeError, match="XLM_NOPE"):
        getattr(envs, "XLM_NOPE")  # noqa: B009 (read for its error)
    with pytest.raises(ValueError, match="unknown xlm environment variable 'XLM_NOPE'"):
        envs.is_set("XLM_NOPE")
    monkeypatch.setenv("XLM_API_KEY", "k")
    assert envs.is_set("XLM_API_KEY") and "XLM_API_KEY" in dir(envs)


XLM_MULTIHOST = ("XLM_COORDINATOR_ADDRESS", "XLM_NUM_PROCESSES", "XLM_PROCESS_ID")


@pytest.fixture
def pod_env(monkeypatch):
    """No pod variable set; returns a setter."""
    for name in (*envs.POD_VARIABLES, *XLM_MULTIHOST):
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_pod_environment_of_each_platform(pod_env):
    assert envs.pod_environment() == envs.PodEnvironment()
    pod_env(JOB_COMPLETION_INDEX="3")
    assert envs.pod_environment() == envs.PodEnvironment(3, None, None, "indexed-job")
    pod_env(TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES="t-w-0, t-w-1,t-w-2,t-w-3")
    assert envs.pod_environment() == envs.PodEnvironment(1, 4, "t-w-0:8476", "tpu-vm")
    pod_env(LWS_WORKER_INDEX="2", LWS_GROUP_SIZE="3", LWS_LEADER_ADDRESS="g-0.svc")
    pod_env(JAX_COORDINATOR_PORT="9000")
    assert envs.pod_environment() == envs.PodEnvironment(2, 3, "g-0.svc:9000", "lws")


def test_multihost_options_come_from_the_pod_unless_given(pod_env):
    from xlm.engine.arg_utils import EngineArgs
    from xlm.executor.multihost import is_follower

    pod_env(TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES="10.0.0.5,10.0.0.6")
    multihost = EngineArgs(model="m", distributed_executor_backend="multihost")
    config = multihost.create_parallel_config()
    assert (config.coordinator_address, config.num_processes, config.process_id) == (
        "10.0.0.5:8476",
        2,
        1,
    )
    assert is_follower(config)
    # XLM_* and the options win over the pod's; the uni backend reads no pod variable.
    pod_env(XLM_COORDINATOR_ADDRESS="10.0.0.9:1234")
    given = EngineArgs(model="m", distributed_executor_backend="multihost", process_id=0)
    config = given.create_parallel_config()
    assert (config.coordinator_address, config.process_id) == ("10.0.0.9:1234", 0)
    assert not is_follower(config)
    uni = EngineArgs(model="m").create_parallel_config()
    assert (uni.num_processes, uni.process_id) == (None, None)


def test_hugging_face_variables_as_huggingface_hub_reads_them(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert envs.hf_hub_offline() is None
    for value, expected in (("1", True), (" on", True), ("TRUE", True), ("0", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert envs.hf_hub_offline() is expected
        assert constants._is_true(value.strip()) is expected  # huggingface_hub's own rule
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    assert envs.hf_hub_cache() is None
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert envs.hf_hub_cache() == str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert envs.hf_hub_cache() == str(tmp_path / "c")


def test_transformers_advisories_are_quiet_unless_set(monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
    envs.quiet_transformers_advisories()
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "0")
    envs.quiet_transformers_advisories()
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "0"


def test_only_envs_reads_or_writes_the_environment():
    """Every environment variable xlm reads or sets goes through xlm/envs.py."""
    import pathlib
    import re

    root = pathlib.Path(envs.__file__).parent
    pattern = re.compile(r"os\.environ|os\.getenv|os\.putenv")
    offenders = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "envs.py" or path.parent != root
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == [], offenders


def test_deviceless_libtpu_and_gpu_memory_fraction(monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "0")  # the user's choice stays
    envs.allow_deviceless_libtpu()
    assert os.environ["TPU_ACCELERATOR_TYPE"] == ""
    assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "0"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert envs.gpu_memory_fraction() == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert envs.gpu_memory_fraction() == 0.5
    monkeypatch.setenv("XLM_TEST_SET_VARIABLES", "")
    envs.set_variables({"XLM_TEST_SET_VARIABLES": "1"})
    assert os.environ["XLM_TEST_SET_VARIABLES"] == "1"
