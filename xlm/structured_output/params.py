"""StructuredOutputsParams: one constraint on a request's output (vLLM's name and fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The kinds of constraint, in the order vLLM lists them; exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    text = repr(value)
    if len(text) > 200:
        text = text[:200] + "..."
    return ValueError(f"StructuredOutputsParams.{name}={text} is invalid: allowed {allowed}")


@dataclass
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark, llguidance's
    dialect). ``whitespace_pattern`` (a regex) replaces the JSON whitespace between tokens;
    ``disable_additional_properties`` closes objects whose schema does not say otherwise.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        if self.choice is not None and not isinstance(self.choice, str):
            try:
                self.choice = list(self.choice)
            except TypeError:
                raise _invalid("choice", self.choice, "a non-empty list of strings") from None
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise _invalid("json", self.json, f"a JSON schema (not valid JSON: {e})") from None
        self._verify()

    def _verify(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise _invalid("json", self.json, "a JSON schema (an object, or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _invalid("regex", self.regex, "a non-empty regular expression string")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise _invalid("choice", self.choice, "a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise _invalid("grammar", self.grammar, "a non-empty Lark grammar string")
        if self.json_object is not None and self.json_object is not True:
            raise _invalid("json_object", self.json_object, "True (or None)")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _invalid("whitespace_pattern", self.whitespace_pattern, "a regex string")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def cache_key(self) -> str:
        """A stable string naming the constraint (equal specs share one compiled grammar)."""
        return json.dumps(
            [
                self.kind,
                getattr(self, self.kind),
                self.whitespace_pattern,
                self.disable_additional_properties,
            ],
            sort_keys=True,
            separators=(",", ":"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able dict (a schema travels as its JSON text)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(out["json"], dict):
            out["json"] = json.dumps(out["json"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """Inverse of ``to_dict``; also accepts vLLM's request JSON (unknown keys are errors)."""
        if not isinstance(data, dict):
            raise ValueError(
                f"structured_outputs={data!r} is invalid: allowed an object with one of "
                f"{', '.join(CONSTRAINT_FIELDS)}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown fields {unknown}: allowed {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def restore(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """Inverse of ``to_dict`` for parameters checked already (no second check)."""
        params = cls.__new__(cls)
        for f in fields(cls):
            setattr(params, f.name, data[f.name])
        if isinstance(params.json, str):
            params.json = json.loads(params.json)
        return params
