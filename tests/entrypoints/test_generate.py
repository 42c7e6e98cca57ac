"""`xlm generate`'s start-up path: what it imports before the first token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from xlm.models.loader.gguf_config import cached_gguf_config
from xlm.tokenizer import get_tokenizer

# Seconds of imports a warm `xlm generate` of a GGUF model does not need: transformers'
# configuration module imports torch (where installed); the server's and Ray's stacks.
HEAVY = ("torch", "transformers.configuration_utils", "fastapi", "uvicorn", "ray")

_SCRIPT = """
import json, sys
from xlm.entrypoints.cli import build_parser
import xlm.entrypoints.generate
import xlm.executor.uniproc, xlm.worker.worker  # what the engine runs
from xlm.engine.arg_utils import EngineArgs
from xlm.tokenizer import get_tokenizer

args = build_parser("generate").parse_args(["generate", "--model", sys.argv[1], "hi"])
EngineArgs.from_cli_args(args).create_config()
get_tokenizer(sys.argv[1])
print(json.dumps(sorted(m for m in sys.argv[2:] if m in sys.modules)))
"""


def test_warm_generate_path_skips_heavy_imports(smollm2_gguf):
    # Warm the cache as a first `xlm generate` does: the config snapshot, the tokenizer.
    cached_gguf_config(smollm2_gguf)
    get_tokenizer(smollm2_gguf)
    env = {**os.environ, "XLM_CPU_KERNELS": "0"}  # no kernel build: imports only
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, smollm2_gguf, *HEAVY],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # The check sees an import: the same script names the modules it did import.
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, smollm2_gguf, "jax", "tokenizers"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["jax", "tokenizers"]
