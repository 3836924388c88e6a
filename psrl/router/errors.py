"""Typed router errors, each mapped once to an HTTP status, a JSON body and an `x-smg-error-code` header."""

from __future__ import annotations

import json
from typing import Any

from psrl.serving.http1 import Response

ERROR_CODE_HEADER = "x-smg-error-code"


class RouterError(Exception):
    status: int = 500
    code: str = "internal_error"  # the body's `code`, and the header's unless header_code says otherwise
    header_code: str | None = None
    error_type: str = "server_error"
    stage: str | None = None  # the pipeline stage the request failed in (set by the pipeline runner)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        # OpenAI's error shape, so the official clients raise a readable exception.
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> Response:
        headers = {ERROR_CODE_HEADER: self.header_code or self.code}
        return Response(json.dumps(self.body()), self.status, "application/json", headers)


class BadRequest(RouterError):
    status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class PromptOverflow(BadRequest):
    """The prompt (with max_tokens) does not fit the context. Two readers: client libraries (openai, litellm)
    classify a context-window error by the body's OpenAI code; PSRL reads the header (docs/compat.md section 4)."""

    code = "context_length_exceeded"
    header_code = "prompt_overflow"


class RequestAborted(BadRequest):
    """The PSManager aborted the request (e.g. its version was dropped): not retried."""

    code = "request_aborted"


class Unauthorized(RouterError):
    status = 401
    code = "unauthorized"
    error_type = "authentication_error"


class NotFound(RouterError):
    status = 404
    code = "not_found"
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(RouterError):
    status = 409
    code = "conflict"
    error_type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    status = 413
    code = "payload_too_large"
    error_type = "invalid_request_error"


class WorkerUnavailable(RouterError):
    """No instance can take the request, or the chosen one could not be reached."""

    status = 503
    code = "worker_unavailable"


class WorkerStreamFailed(RouterError):
    """The replica accepted the request and then failed or vanished mid-stream."""

    status = 502
    code = "stream_drain_failed"


class WorkerTimeout(RouterError):
    status = 504
    code = "worker_timeout"


class WorkerInternalError(RouterError):
    status = 500
    code = "worker_error"
