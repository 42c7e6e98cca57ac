"""`xlm generate` on the command line prints what LLM.generate returns; bad flags fail cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import xlm
from tests.engine.reference import TINY_ENGINE, cli_engine_flags

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
    llm = xlm.LLM(model=tiny_path, **TINY_ENGINE)
    params = xlm.SamplingParams(temperature=0.0, max_tokens=8)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert expected.strip()

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
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


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
