"""Routed experts of one request: the top-k expert ids of every MoE layer for each position fed to the model,
from the position the request asked for on (vLLM's `routed_experts_prompt_start`)."""

from __future__ import annotations

import numpy as np


def expert_id_dtype(num_experts: int) -> np.dtype:
    """vLLM's choice (RoutedExpertsCapturer): the narrowest unsigned type holding every expert id."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


class RoutingRecorder:
    """Rows for positions [start, frontier), row i holding position start + i as `[num_layers, top_k]`.

    Rows are written by position, so a position computed again (recompute after a preemption) overwrites its
    row instead of appending one; `frontier` only grows. The request's rows stay contiguous because the
    scheduler never serves a position at or past the frontier from cached or migrated KV (Request.kv_reuse_limit).
    """

    __slots__ = ("_buf", "frontier", "start")

    def __init__(self, start: int, num_layers: int, top_k: int, dtype: np.dtype) -> None:
        self.start = start
        self.frontier = start
        self._buf = np.zeros((16, num_layers, top_k), dtype=dtype)

    def write(self, first_position: int, rows: np.ndarray) -> None:
        """`rows` [n, num_layers, top_k] of positions [first_position, first_position + n); those before `start`
        are not kept."""
        skip = max(self.start - first_position, 0)
        if skip >= rows.shape[0]:
            return
        lo = first_position + skip - self.start
        hi = lo + rows.shape[0] - skip
        if hi > self._buf.shape[0]:
            grown = np.zeros((max(hi, 2 * self._buf.shape[0]), *self._buf.shape[1:]), dtype=self._buf.dtype)
            grown[: self._buf.shape[0]] = self._buf
            self._buf = grown
        self._buf[lo:hi] = rows[skip:]
        self.frontier = max(self.frontier, self.start + hi)

    def rows(self) -> np.ndarray:
        """A copy of the rows recorded so far, [frontier - start, num_layers, top_k]."""
        return self._buf[: self.frontier - self.start].copy()
