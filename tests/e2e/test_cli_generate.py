"""`xlm generate` on the command line prints what LLM.generate returns; bad flags fail cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import xlm
from tests.engine.reference import SMOLLM2_ENGINE, TINY_ENGINE, cli_engine_flags, tiny_engine

PROMPT = "w10 w20 w30 w40 w50"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1")
    return subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.mark.slow
def test_generate_prints_the_greedy_completion(tiny_path):
    llm = tiny_engine(tiny_path)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=8)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert expected.strip()

    started = time.monotonic()
    result = run_cli(
        "--model",
        tiny_path,
        PROMPT,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        *cli_engine_flags(TINY_ENGINE),
    )
    wall_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    # Start-up is printed by phase, per process (the engine core runs in its own, spawned
    # first), and the phases add up to the total printed, which is part of the process's
    # life as timed from outside it; importing jax takes time.
    total, phases = parse_startup_line(result.stderr)
    assert 0 < total < wall_s
    assert phases["imports"] > 0
    assert list(phases) == ["imports", "engine core process", "tokenizer"]
    core_total, core = parse_startup_line(result.stderr, "Engine core process")
    assert 0 < core_total < wall_s
    assert list(core)[:2] == ["imports", "config"]
    assert {"weights", "KV cache", "programs"} <= set(core)
    assert "First step (" in result.stderr


# What `xlm generate` must not pay for: the server, the cluster runner, structured output.
UNUSED_BY_GENERATE = ("fastapi", "uvicorn", "starlette", "prometheus_client", "ray", "llguidance")
IMPORTED = """
import sys
from xlm.entrypoints.cli import main
code = main(sys.argv[1:])
print("loaded:", sorted(m for m in {unused} if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.slow
def test_generate_imports_no_server_or_cluster_modules(tiny_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLM_TARGET_PLATFORM")}
    args = ["generate", "--model", tiny_path, PROMPT, "--max-tokens", "2"]
    args += cli_engine_flags(TINY_ENGINE)
    result = subprocess.run(
        [sys.executable, "-c", IMPORTED.format(unused=UNUSED_BY_GENERATE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "XLM_DISABLE_PROGRESS_BARS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "loaded: []" in result.stdout, result.stdout
    assert "E0000" not in result.stderr  # no backend of an absent accelerator started


@pytest.mark.slow
def test_a_cold_gguf_start_writes_its_placed_cache_after_the_first_token(smollm2_gguf, tmp_path):
    """Cold: the GGUF is dequantized in memory and its parameters saved as placed after
    the first step (before the process exits); warm: loaded from that cache without
    dequantizing, the same greedy token."""
    env = dict(os.environ, XLM_CACHE_ROOT=str(tmp_path / "cache"), XLM_DISABLE_PROGRESS_BARS="1")
    argv = [sys.executable, "-m", "xlm.entrypoints.cli", "generate", "--model", smollm2_gguf]
    argv += ["The capital of France is", "--max-tokens", "1", "--temperature", "0"]
    argv += cli_engine_flags(SMOLLM2_ENGINE)
    runs = [
        subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env) for _ in range(2)
    ]
    for result in runs:
        assert result.returncode == 0, result.stderr
    cold, warm = (r.stderr for r in runs)
    assert "GGUF dequantized; cached after the first step" in cold
    assert cold.index("First step (") < cold.index("Saving the placed weights")
    assert "placed GGUF weights from the cache" in warm and "Saving the placed" not in warm
    assert "Dequantizing" not in cold + warm  # no copy in the checkpoint's layout on a CPU
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()
    assert len(list((tmp_path / "cache" / "gguf_placed").iterdir())) == 1  # no .tmp-* left


def parse_startup_line(stderr: str, what: str = "Engine") -> tuple[float, dict[str, float]]:
    """The total and phase -> seconds from the "{what} ready in T s: name S s, ..." line
    (the sum checked)."""
    line = next(x for x in stderr.splitlines() if f"] {what} ready in" in x)
    total, _, rest = line.split(f"{what} ready in ", 1)[1].partition(" s: ")
    # "name S s" or "name S s (note)", joined by ", "; notes may hold commas.
    parts = re.findall(r"([A-Za-z][A-Za-z ]*?) ([0-9.]+) s(?: \([^)]*\))?(?:, |\.$)", rest)
    phases = {name: float(seconds) for name, seconds in parts}
    assert abs(sum(phases.values()) - float(total)) < 0.05 + 0.01 * len(phases)
    return float(total), phases


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--max-model-len", "abc"], "--max-model-len"),
    ],
)
def test_bad_sampling_flag_exits_with_a_clear_message(tiny_path, flags, message):
    result = run_cli("--model", tiny_path, PROMPT, *cli_engine_flags(TINY_ENGINE), *flags)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-model-len", "100000"], "max_model_len"),
        (["--dtype", "float99"], "dtype"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
    ids=["max_model_len", "dtype", "missing_model"],
)
def test_bad_engine_flag_exits_with_a_clear_message(tiny_path, flags, message):
    result = run_cli("--model", tiny_path, PROMPT, *cli_engine_flags(TINY_ENGINE), *flags)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Reported once: the engine process, spawned before the config is built, refuses the
    # same config quietly.
    assert sum("error" in line.lower() for line in result.stderr.splitlines()) == 1, result.stderr
