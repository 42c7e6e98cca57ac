"""The `xlm` command line: subcommands listed without importing them, errors as one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import xlm
from xlm.entrypoints.cli import SUBCOMMANDS, build_parser, main


def test_every_subcommand_is_listed_and_only_the_chosen_one_has_its_flags():
    parser = build_parser("convert")
    help_text = parser.format_help()
    for name in SUBCOMMANDS:
        assert name in help_text
    args = parser.parse_args(["convert", "in.gguf", "out", "--dtype", "bfloat16"])
    assert (args.model, args.output_dir, args.dtype) == ("in.gguf", "out", "bfloat16")
    with pytest.raises(SystemExit):  # generate was only listed: it takes no flags here
        parser.parse_args(["generate", "--max-tokens", "3"])


def test_no_subcommand_prints_the_help(capsys):
    assert main([]) == 0
    assert "COMMAND" in capsys.readouterr().out


def test_a_bad_serve_config_file_is_one_line(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlm serve: error: ") and err.count("\n") == 1


def test_version_and_no_eager_imports(capsys):
    code = (
        "import sys; from xlm.entrypoints.cli import build_parser; build_parser('convert');"
        "print('xlm.entrypoints.openai.api_server' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the server's modules stay unimported
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"xlm {xlm.__version__}\n"


@pytest.fixture
def qwen_vl_config_dir(tmp_path):
    """A Qwen2-VL config.json (no weights: start-up fails before they are read)."""
    from tests.qwen2_vl_fixtures import _configs

    _configs(False).save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize("command", ["serve", "generate", "run-batch"])
def test_bad_mm_processor_kwargs_stop_start_up_in_one_line(
    command, qwen_vl_config_dir, tmp_path, capsys
):
    """Every engine command takes --mm-processor-kwargs; a key the model's processor does
    not take stops start-up with one line naming it and the allowed ones (no server runs,
    so no request ever gets a 400 for it)."""
    if command == "serve":
        argv = [command, qwen_vl_config_dir]
    else:
        argv = [command, "--model", qwen_vl_config_dir]
    if command == "run-batch":
        batch = tmp_path / "in.jsonl"
        batch.write_text(
            '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            '"body": {"model": "m", "prompt": "w1"}}\n'
        )
        argv += ["-i", str(batch), "-o", str(tmp_path / "out.jsonl")]
    argv += ["--mm-processor-kwargs", '{"max_pixel": 4096}']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xlm {command}: error: ") and err.count("\n") == 1
    assert "'max_pixel'" in err and "allowed min_pixels, max_pixels, size" in err
