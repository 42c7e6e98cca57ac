"""`xlm serve`'s own checks: `--headless` needs a start rank past the server's and the
API server's address (one line on stderr, exit code 2); the engine process is spawned
before the API server's imports and its config."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xlm.entrypoints.cli import main


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--data-parallel-size", "2"], "--data-parallel-start-rank=0"),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1"],
            "data_parallel_address=None",
        ),
    ],
)
def test_headless_without_its_ranks_place_is_one_line(tiny_checkpoint, capsys, flags, message):
    model = tiny_checkpoint("llama")
    capsys.readouterr()  # the checkpoint's progress bar
    assert main(["serve", model, "--headless", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlm serve: error: ") and message in err, err


# Runs `xlm serve` in a fresh interpreter up to the engine's spawn, then stops there: which
# server modules that process had imported by then.
_SPAWN_PROBE = """
import sys
from xlm.entrypoints import cli, serve

def probe(config, log_stats=True):
    heavy = ("fastapi", "jax", "transformers", "uvicorn", "xlm.entrypoints.openai.api_server")
    print("imported at spawn:", sorted(m for m in heavy if m in sys.modules))
    sys.exit(0)

serve.start_engine_process = probe
cli.main(["serve", sys.argv[1], "--port", "0"])
"""


def test_engine_process_is_spawned_before_the_server_imports(tiny_checkpoint):
    """The engine loads while the API server builds the config (importing JAX and
    transformers) and imports FastAPI and its handlers."""
    model = tiny_checkpoint("llama")
    out = subprocess.run(
        [sys.executable, "-c", _SPAWN_PROBE, model],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "imported at spawn: []" in out.stdout, out.stdout + out.stderr
