"""`xlm convert`: a GGUF file becomes a safetensors directory; a bad path is one clear line.
(tests/models/loader/test_gguf.py checks the converted weights against transformers.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from safetensors.numpy import load_file

from tests.models.gguf_fixtures import random_hf_state_dict, write_gguf
from xlm.entrypoints.cli import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_convert_writes_the_directory_in_the_dtype_asked(tmp_path, capsys):
    state = random_hf_state_dict("llama", seed=2)
    path = write_gguf(str(tmp_path / "tiny.gguf"), "llama", state)
    out = tmp_path / "hf"
    assert main(["convert", path, str(out), "--dtype", "float16"]) == 0
    assert capsys.readouterr().out == f"Wrote {out}\n"
    weights = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert weights[name].dtype.name == "float16"
    assert (weights[name] == state[name].astype("float16")).all()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_cli_convert_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    missing = str(tmp_path / "missing.gguf")
    result = subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", "convert", missing, str(tmp_path / "o")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert missing in result.stderr and "Traceback" not in result.stderr
