"""`xlm convert`: write a Hugging Face safetensors directory from a GGUF file."""

from __future__ import annotations

import argparse
from typing import Any

from xlm.entrypoints import console
from xlm.models.builtin import resolve_model_name


def _run(args: argparse.Namespace) -> int:
    from xlm.models.loader.gguf import gguf_to_safetensors

    try:
        path = resolve_model_name(args.model)
        out_dir = gguf_to_safetensors(path, args.output_dir, dtype=args.dtype)
    except (FileNotFoundError, ImportError, ValueError) as e:
        console.err(f"xlm convert: {e}")
        return 1
    console.out(f"Wrote {out_dir}")
    return 0


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("model", help="a .gguf file or a built-in model name (smollm2-135m)")
    parser.add_argument("output_dir", metavar="OUTDIR", help="directory to write")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the written weights (default: float32)",
    )
    parser.set_defaults(func=_run)
