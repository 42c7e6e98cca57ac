"""`xlm serve`'s own checks: `--headless` needs a start rank past the server's and the
API server's address (one line on stderr, exit code 2)."""

from __future__ import annotations

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
