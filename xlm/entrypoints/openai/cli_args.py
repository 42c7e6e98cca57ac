"""`xlm serve MODEL [flags]`: the server's flags, engine flags, and --config FILE.yaml."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from xlm import envs
from xlm.engine.arg_utils import EngineArgs
from xlm.entrypoints.openai.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_N,
    WAITING_PER_SEQ,
)
from xlm.entrypoints.openai.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES
from xlm.sampling_params import MAX_DEVICE_LOGPROBS


def _origins(value: str) -> list[str]:
    """--allowed-origins as a JSON list or a comma list."""
    value = value.strip()
    if value.startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list):
            raise argparse.ArgumentTypeError("--allowed-origins must be a list")
        return [str(v) for v in parsed]
    return [v.strip() for v in value.split(",") if v.strip()]


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter of --lora-modules: the name requests use, its directory, its base model."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One --lora-modules value: `name=path`, or vLLM's JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    value = value.strip()
    if value.startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise argparse.ArgumentTypeError(f"{value!r}: expected an object")
        unknown = set(data) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{value!r}: unknown keys {sorted(unknown)}; allowed name, path, base_model_name"
            )
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
    else:
        name, sep, path = value.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"{value!r}: expected name=path or a JSON object")
    for key, item in (("name", name), ("path", path)):
        if not isinstance(item, str) or not item.strip():
            raise argparse.ArgumentTypeError(f"{value!r}: {key} must not be empty")
    if base is not None and (not isinstance(base, str) or not base):
        raise argparse.ArgumentTypeError(f"{value!r}: base_model_name must be a non-empty string")
    return LoRAModulePath(name.strip(), path.strip(), base)


def add_lora_args(parser: argparse.ArgumentParser, runtime: bool) -> None:
    """--lora-modules (the server and run-batch); with `runtime`, the server's own
    --lora-root and --allow-runtime-lora-updating."""
    group = parser.add_argument_group("LoRA adapters (need --enable-lora)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start, each selected by a request's model=NAME; "
        'name=path or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    if not runtime:
        return
    group.add_argument(
        "--lora-root",
        default=None,
        help="the only directory tree POST /v1/load_lora_adapter may load from (paths "
        "resolved, symlinks included; a relative lora_path is under it)",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-root)",
    )


def check_lora_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for LoRA options that cannot work together.

    --lora-modules paths are the operator's own configuration: they need not be under
    --lora-root, which bounds only what clients load at run time.
    """
    modules = list(getattr(args, "lora_modules", None) or [])
    root = getattr(args, "lora_root", None)
    runtime = getattr(args, "allow_runtime_lora_updating", False)
    if not getattr(args, "enable_lora", False):
        given = [
            flag
            for flag, on in (
                ("--lora-modules", modules),
                ("--lora-root", root is not None),
                ("--allow-runtime-lora-updating", runtime),
            )
            if on
        ]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{' and '.join(given)} {verb} --enable-lora")
        return
    if runtime and root is None:
        raise ValueError(
            "--allow-runtime-lora-updating needs --lora-root DIR: the directory tree "
            "clients may load adapters from"
        )
    if root is not None and not os.path.isdir(root):
        raise ValueError(f"--lora-root {root!r} is not a directory")
    served = list(getattr(args, "served_model_name", None) or [args.model])
    seen: set[str] = set()
    for module in modules:
        if module.name in served or module.name in seen:
            raise ValueError(
                f"--lora-modules {module.name}: the name is already taken (served model "
                f"names {served}, or another adapter)"
            )
        seen.add(module.name)
        if not os.path.isdir(module.path):
            raise ValueError(
                f"--lora-modules {module.name}={module.path}: no such adapter directory"
            )
        if module.base_model_name is not None and module.base_model_name not in served:
            raise ValueError(
                f"--lora-modules {module.name}: base_model_name {module.base_model_name!r} is "
                f"not a served model name ({served})"
            )


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the HTTP server itself."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to listen on (0: a free one, logged once bound)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: the model argument)",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="no API server: run this host's data-parallel ranks (--data-parallel-size-local "
        "from --data-parallel-start-rank) for the API server at --data-parallel-address:"
        "--data-parallel-rpc-port",
    )
    _add_access_args(group)
    _add_request_limit_args(group)
    _add_responses_store_args(group)
    group.add_argument("--chat-template", default=None, help="Jinja chat template file or string")
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json"),
        help="how tool_choice='auto' finds the model's tool calls in its reply",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse the model's own tool calls (tool_choice='auto'; needs --tool-call-parser)",
    )
    group.add_argument(
        "--enable-log-requests", action="store_true", help="log every request's parameters"
    )
    group.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic stats log line"
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted",
    )
    group.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level")


def _add_access_args(group: Any) -> None:
    """Who may call the server: the API key and CORS."""
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version "
        "and /metrics (default: $XLM_API_KEY)",
    )
    group.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="also require the API key on /metrics",
    )
    group.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        help="CORS origins allowed to call the API from a browser, as a JSON or comma list "
        "(default: none, no CORS headers)",
    )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let CORS requests carry credentials (refused with a '*' origin)",
    )


def _add_request_limit_args(group: Any) -> None:
    """What one request, and the queue, may ask of the server."""
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="sequences that may wait beyond --max-num-seqs; past it new requests get 429 "
        f"(default: {WAITING_PER_SEQ} x max-num-seqs)",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"largest n / best_of a request may ask for (default {DEFAULT_MAX_N})",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger is 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in chat requests (refused by default)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_DEVICE_LOGPROBS,
        help="largest logprobs / top_logprobs / prompt_logprobs a request may ask for "
        f"(default {MAX_DEVICE_LOGPROBS}, the most the device returns)",
    )


def _add_responses_store_args(group: Any) -> None:
    """Bounds of the /v1/responses store (previous_response_id, GET /v1/responses/{id})."""
    group.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="responses kept for previous_response_id, oldest evicted first; 0 keeps none "
        f"(default {DEFAULT_MAX_ENTRIES})",
    )
    group.add_argument(
        "--responses-store-max-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help=f"seconds a stored response is kept (default {DEFAULT_MAX_AGE_S:.0f})",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags: EngineArgs' own (--served-model-name is the server's, with aliases)."""
    EngineArgs.add_cli_args(parser, skip=("served_model_name",))


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of parsed arguments (picklable: the engine process builds its config
    from them)."""
    engine_args = EngineArgs.from_cli_args(args)
    if args.served_model_name:
        engine_args.served_model_name = args.served_model_name[0]
    return engine_args


def create_engine_config(args: argparse.Namespace) -> Any:
    """The XlmConfig for parsed arguments."""
    return engine_args_from(args).create_config()


def config_file_args(path: str) -> list[str]:
    """A YAML mapping of long option names to values, as command-line arguments."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    return mapping_args(data)


def mapping_args(data: dict[str, Any]) -> list[str]:
    """A mapping of long option names (`max_num_seqs`, or `model` for the positional) to
    values, as command-line arguments (True: --flag, False: --no-flag, a list: its items)."""
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if key in ("model", "model_tag"):
            argv.append(str(value))
        elif value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, list):  # mappings (--lora-modules entries) as JSON
            argv.extend([flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)])
        elif value is not None:
            argv.extend([flag, str(value)])
    return argv


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Fill a parser with the serve flags."""
    parser.add_argument("model_tag", nargs="?", default=None, help="model path or built-in name")
    parser.add_argument("--config", default=None, help="YAML file of flags (CLI flags win)")
    add_serving_args(parser)
    add_lora_args(parser, runtime=True)
    add_engine_args(parser)
    return parser


def parse_serve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `serve` arguments, expanding --config FILE first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_arg_parser(argparse.ArgumentParser(prog="xlm serve"))
    return finish_args(parser, argv)


def expand_config_file(argv: list[str]) -> list[str]:
    """`serve` arguments with --config FILE replaced by the file's flags (CLI flags win).

    The file's flags go first so that later command-line flags override them; `--config
    FILE` stays at the end so `args.config` still names the file.
    """
    if "--config" not in argv:
        return list(argv)
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise ValueError("--config needs a file")
    path = argv[i + 1]
    file_args = config_file_args(path)
    rest = argv[:i] + argv[i + 2 :]
    # A positional model given on the command line wins over the file's.
    positional_in_rest = rest and not rest[0].startswith("-")
    if positional_in_rest and file_args and not file_args[0].startswith("-"):
        file_args = file_args[1:]
    expanded = (rest[:1] + file_args + rest[1:]) if positional_in_rest else file_args + rest
    return expanded + ["--config", path]


def check_max_logprobs(max_logprobs: int) -> None:
    """--max-logprobs within what the device returns (ValueError naming the range)."""
    if not 0 <= max_logprobs <= MAX_DEVICE_LOGPROBS:
        raise ValueError(
            f"--max-logprobs={max_logprobs} is invalid: allowed [0, {MAX_DEVICE_LOGPROBS}] "
            f"(the engine returns at most {MAX_DEVICE_LOGPROBS} logprobs per token)"
        )


def finish_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Expand --config, parse, and settle model / api_key defaults."""
    if "--config" in argv and argv.index("--config") + 1 >= len(argv):
        parser.error("--config needs a file")
    return settle_args(parser, parser.parse_args(expand_config_file(argv)))


def settle_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Model from the positional argument; api key from $XLM_API_KEY."""
    if args.model_tag is not None:
        args.model = args.model_tag
    if not getattr(args, "model", None):
        parser.error("a model is required: xlm serve MODEL")
    if args.api_key is None:
        args.api_key = envs.XLM_API_KEY
    try:
        check_max_logprobs(args.max_logprobs)
    except ValueError as e:
        parser.error(str(e))
    if args.max_n < 1:
        parser.error(f"--max-n={args.max_n} is invalid: must be >= 1")
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes={args.max_request_body_bytes} must be >= 1")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        parser.error(f"--max-waiting-requests={args.max_waiting_requests} must be >= 0")
    if args.allow_credentials and "*" in args.allowed_origins:
        parser.error("--allow-credentials cannot be used with the '*' origin: list the origins")
    if args.responses_store_max_entries < 0 or args.responses_store_max_age <= 0:
        parser.error("--responses-store-max-entries must be >= 0 and --responses-store-max-age > 0")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        check_lora_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args
