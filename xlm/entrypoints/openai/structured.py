"""OpenAI request fields -> one StructuredOutputsParams: response_format, vLLM's
``structured_outputs`` and older ``guided_*`` fields, and tool_choice "required" / named.

Each mapping error is a RequestValidationError naming the field (HTTP 400).
"""

from __future__ import annotations

from typing import Any

from xlm.entrypoints.openai.limits import RequestValidationError
from xlm.structured_output.params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise RequestValidationError(f"{field}: {e}", field) from None


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise RequestValidationError("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise RequestValidationError(
                "response_format.json_schema must be an object with a 'schema' object",
                "response_format",
            )
        # OpenAI's strict mode: objects admit only the listed properties.
        return _params(
            "response_format",
            json=spec.get("schema", {}),
            disable_additional_properties=bool(spec.get("strict")),
        )
    raise RequestValidationError(
        f"response_format type {kind!r} is invalid: allowed 'text', 'json_object', 'json_schema'",
        "response_format",
    )


def constraint_of_request(request: Any) -> StructuredOutputsParams | None:
    """The constraint of a completion or chat request (at most one source may set it)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format)
        if params is not None:
            found.append(("response_format", params))
    if request.structured_outputs is not None:
        try:
            params = StructuredOutputsParams.from_dict(request.structured_outputs)
        except (ValueError, TypeError) as e:
            raise RequestValidationError(str(e), "structured_outputs") from None
        found.append(("structured_outputs", params))
    for field, name in _GUIDED.items():
        value = getattr(request, field)
        if value is not None:
            found.append((field, _params(field, **{name: value})))
    if len(found) > 1:
        raise RequestValidationError(
            f"give at most one structured output constraint; got {[f for f, _ in found]}",
            found[1][0],
        )
    return found[0][1] if found else None


# ---- tools ---------------------------------------------------------------------------------


def function_specs(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """Validated ``tools``: function name -> its parameters schema."""
    specs: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise RequestValidationError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                "'parameters': {...}}}}",
                "tools",
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RequestValidationError(
                f"tools[{i}].function.parameters must be an object", "tools"
            )
        specs[function["name"]] = parameters
    return specs


def named_tool(tool_choice: Any) -> str | None:
    """The function name of a named tool_choice ({"type": "function", "function": {...}})."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        raise RequestValidationError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    return None


def required_tool_calls_schema(specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of a non-empty array of {"name", "parameters"} calls of the given tools."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in specs.items()
            ]
        },
    }


def tool_choice_mode(request: Any) -> str:
    """ "none", "auto", "required" or "named" (tool_choice defaults like OpenAI's)."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise RequestValidationError("tool_choice needs tools", "tool_choice")
        return "none"
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    named_tool(choice)
    return "named"


def constraint_of_chat_request(request: Any) -> StructuredOutputsParams | None:
    """A chat request's constraint: its own, or the tool-call JSON tool_choice forces."""
    constraint = constraint_of_request(request)
    mode = tool_choice_mode(request)
    if mode not in ("required", "named"):
        return constraint
    if constraint is not None:
        raise RequestValidationError(
            f"tool_choice={request.tool_choice!r} constrains the output already: drop the "
            "other structured output constraint",
            "tool_choice",
        )
    specs = function_specs(request.tools)
    if mode == "required":
        return _params("tool_choice", json=required_tool_calls_schema(specs))
    name = named_tool(request.tool_choice)
    if name not in specs:
        raise RequestValidationError(
            f"tool_choice names function {name!r}, which is not in tools: allowed {sorted(specs)}",
            "tool_choice",
        )
    return _params("tool_choice", json=specs[name])
