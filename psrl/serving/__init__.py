"""What the router and the SessionRouter share as HTTP servers: the uvicorn protocol that bounds every
connection (body size, read timeouts, JSON errors for framing problems) and bounded JSON body parsing."""

from psrl.serving.json_body import MAX_JSON_DEPTH, JsonBodyError, loads_bounded, may_hold_surrogates
from psrl.serving.protocol import HttpLimits, HttpServerSettings, RenderError, guarded_protocol

__all__ = [
    "MAX_JSON_DEPTH",
    "HttpLimits",
    "HttpServerSettings",
    "JsonBodyError",
    "RenderError",
    "guarded_protocol",
    "loads_bounded",
    "may_hold_surrogates",
]
