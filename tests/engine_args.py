"""Engine options written once for a test, used both as LLM(...) keywords and as CLI flags."""

from __future__ import annotations

from typing import Any


def cli_flags(engine: dict[str, Any]) -> list[str]:
    """LLM(...) keywords -> the same options as `xlm` command-line flags."""
    flags = []
    for name, value in engine.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list | tuple):
            flags.append(f"{flag}={','.join(map(str, value))}")
        else:
            flags.append(f"{flag}={value}")
    return flags
