"""The examples run as written (on the built-in SmolLM2, small engine shapes) and print text."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.reference import SMOLLM2_ENGINE, cli_engine_flags

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    # Same engine shapes as the session's SmolLM2 engine: compiled programs come from the
    # session compilation cache. The model is the example's default (smollm2-135m).
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *cli_engine_flags(SMOLLM2_ENGINE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_offline_inference_example(smollm2_gguf):
    result = run_example("offline_inference.py", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    completions = [
        ast.literal_eval(c) for c in re.findall(r"^Completion: (.*)$", result.stdout, flags=re.M)
    ]
    assert len(completions) == 4
    assert all(c.strip() for c in completions), result.stdout


@pytest.mark.slow
def test_chat_example(smollm2_gguf):
    result = run_example("chat.py", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    match = re.search(r"^Assistant: (.*)$", result.stdout, flags=re.M)
    assert match and match.group(1).strip(), result.stdout


@pytest.mark.slow
def test_structured_outputs_example(smollm2_gguf):
    result = run_example("structured_outputs.py", "--max-tokens", "120")
    assert result.returncode == 0, result.stderr
    lines = dict(re.findall(r"^(JSON|Choice|Regex|Tool call): (.*)$", result.stdout, flags=re.M))
    assert set(lines) == {"JSON", "Choice", "Regex", "Tool call"}, result.stdout
    person = json.loads(lines["JSON"])
    assert isinstance(person["name"], str) and 0 <= person["age"] <= 120
    assert lines["Choice"] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", lines["Regex"])
    name, arguments = re.fullmatch(r"(\w+)\((.*)\)", lines["Tool call"]).groups()
    assert name == "get_weather" and json.loads(arguments)["unit"] in ("celsius", "fahrenheit")
