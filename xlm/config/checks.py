"""The checks every config runs on its fields: errors name the owner, field and range."""

from __future__ import annotations

import json
from typing import Any


def _invalid(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner}.{name}={value!r} is invalid: allowed {allowed}")


def parse_json_text(name: str, value: Any) -> Any:
    """An option given as an object or its JSON text (the CLI's): the text parsed, any
    other value as it is (its type is the caller's to check)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={value!r} is invalid: not JSON ({e})") from None


def _require(cond: bool, owner: str, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise _invalid(owner, name, value, allowed)


def _positive_int(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    _require(ok, owner, name, value, "a positive integer" + (" or None" if optional else ""))
