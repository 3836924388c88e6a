"""What the API converters share: their one error, and the chat form of a function tool."""

from __future__ import annotations

from typing import Any


class ApiShapeError(ValueError):
    """A body the converter cannot map; `param` names the offending field (a 400 at the HTTP boundary)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def chat_tools(tools: Any, *, schema_key: str, tool_type: str | None) -> list[dict[str, Any]] | None:
    """Chat-completions function tools from flat `{type?, name, description?, <schema_key>?}` definitions
    (`tool_type`, when set, is the only `type` served: the Responses API's built-in tools are not)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiShapeError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or (tool_type is not None and tool.get("type") != tool_type)
        ):
            kind = f"type: {tool_type!r}, " if tool_type else ""
            raise ApiShapeError(f"tools[{i}] must be a tool {{{kind}name, {schema_key}}}", param=f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get(schema_key) or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out
