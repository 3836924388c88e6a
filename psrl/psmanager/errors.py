"""PSManager errors: the logic's argument/lookup errors (mapped once to gRPC codes) and the client's errors."""

from __future__ import annotations

from typing import Any


class InvalidArgument(ValueError):
    """A malformed call (bad list lengths, a negative version where one is required, an unknown status).
    The servicer answers INVALID_ARGUMENT."""


class UnknownBuffer(LookupError):
    """An admin call named a buffer that is not open. The servicer answers NOT_FOUND."""


class PSManagerError(Exception):
    """A PSManager RPC failed. `code` is the gRPC status code (None when the failure was client-side)."""

    def __init__(self, message: str, code: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class PSManagerUnavailable(PSManagerError):
    """The PSManager could not be reached in time (UNAVAILABLE or DEADLINE_EXCEEDED). Safe to retry later."""
