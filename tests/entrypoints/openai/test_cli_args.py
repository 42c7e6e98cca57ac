"""`xlm serve` argument parsing: positional model, engine flags, --config YAML."""

from __future__ import annotations

import argparse

import pytest

from xlm.entrypoints.openai.cli_args import config_file_args, finish_args, make_arg_parser


def _parse(argv: list[str]) -> argparse.Namespace:
    return finish_args(make_arg_parser(argparse.ArgumentParser()), argv)


def test_positional_model_and_flags():
    args = _parse(
        [
            "smollm2-135m",
            "--port",
            "9001",
            "--max-model-len",
            "512",
            "--served-model-name",
            "a",
            "b",
            "--no-enable-prefix-caching",
        ]
    )
    assert args.model == "smollm2-135m" and args.port == 9001 and args.host == "127.0.0.1"
    assert args.max_model_len == 512 and args.served_model_name == ["a", "b"]
    assert args.enable_prefix_caching is False and args.shutdown_timeout == 30.0


def test_config_file_values_sit_under_the_command_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: smollm2-135m\nport: 9100\nmax_num_seqs: 8\nenable_prefix_caching: false\n"
        "served_model_name: [x, y]\napi-key: k\n"
    )
    assert config_file_args(str(path))[0] == "smollm2-135m"
    args = _parse(["--config", str(path), "--port", "9200"])
    assert args.model == "smollm2-135m" and args.port == 9200  # CLI wins
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False
    assert args.served_model_name == ["x", "y"] and args.api_key == "k"
    other = _parse(["other-model", "--config", str(path)])
    assert other.model == "other-model" and other.port == 9100


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("XLM_API_KEY", "from-env")
    assert _parse(["m"]).api_key == "from-env"
    assert _parse(["m", "--api-key", "flag"]).api_key == "flag"


def test_bad_config_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        config_file_args(str(path))


def test_xlm_serve_config_file_reads_the_given_argv_not_sys_argv(tmp_path, monkeypatch):
    """`xlm serve --config FILE` parses the argv it was given (sys.argv is someone else's)."""
    import sys

    import xlm.entrypoints.openai.api_server as api_server
    from xlm.entrypoints import cli, serve

    path = tmp_path / "serve.yaml"
    path.write_text("model: smollm2-135m\nport: 9100\nmax_num_seqs: 8\n")
    seen: list[argparse.Namespace] = []
    # Neither the engine process (spawned before the server's imports) nor the server runs.
    monkeypatch.setattr(serve, "start_engine_process", lambda *_: None)
    monkeypatch.setattr(api_server, "run_server", lambda args, *_: seen.append(args) or 0)
    monkeypatch.setattr(sys, "argv", ["python", "-m", "pytest", "unrelated"])
    assert cli.main(["serve", "--config", str(path), "--port", "9200"]) == 0
    (args,) = seen
    assert args.model == "smollm2-135m" and args.port == 9200 and args.max_num_seqs == 8
    assert args.config == str(path)


def test_responses_store_flags_default_and_bounds(capsys):
    from xlm.entrypoints.openai.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES

    args = _parse(["smollm2-135m"])
    assert args.responses_store_max_entries == DEFAULT_MAX_ENTRIES
    assert args.responses_store_max_age == DEFAULT_MAX_AGE_S
    args = _parse(["m", "--responses-store-max-entries", "0", "--responses-store-max-age", "5"])
    assert (args.responses_store_max_entries, args.responses_store_max_age) == (0, 5.0)
    for bad in (["--responses-store-max-entries", "-1"], ["--responses-store-max-age", "0"]):
        with pytest.raises(SystemExit):
            _parse(["m", *bad])
        assert "--responses-store-max-age > 0" in capsys.readouterr().err


def test_image_flags_use_vllms_names():
    from xlm.engine.arg_utils import EngineArgs

    args = _parse(
        [
            "m",
            "--limit-mm-per-prompt",
            '{"image": 3}',
            "--allowed-local-media-path",
            "/srv/media",
            "--allowed-media-domains",
            "upload.wikimedia.org,images.example",
            "--max-image-pixels",
            "1000000",
        ]
    )
    engine = EngineArgs.from_cli_args(args)
    assert engine.limit_mm_per_prompt == {"image": 3}
    assert engine.allowed_local_media_path == "/srv/media"
    assert engine.allowed_media_domains == ["upload.wikimedia.org", "images.example"]
    assert engine.max_image_pixels == 1_000_000
    defaults = EngineArgs.from_cli_args(_parse(["m"]))
    assert defaults.allowed_media_domains in (None, [])  # no remote host by default
    assert defaults.allowed_local_media_path is None
