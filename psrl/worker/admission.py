"""Closed admission during a weight sync, shared by both replica kinds.

While a sync pauses a replica (or after it failed), a new Generate is not an error: like the PSRL servicer
with admission closed, it gets one complete frame with finish_reason "abort" and no ids, at once. The router's
partial rollout reads that as "refused here" and selects again.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2

# Initial-metadata key a replica of ours sends once it admits a Generate. Stock vLLM servicers don't send it;
# the router then only knows a request started once a frame arrives. It also ends the router's wait for the
# call to be on the wire (gRPC's wait_for_connection waits for the server's initial metadata).
ACCEPTED_METADATA_KEY = "x-psrl-accepted"


def refused_complete(num_prompt_tokens: int) -> vllm_engine_pb2.GenerateComplete:
    """The frame for a Generate refused because admission is closed: "abort" with nothing produced."""
    return vllm_engine_pb2.GenerateComplete(
        output_ids=[], finish_reason="abort", prompt_tokens=num_prompt_tokens, completion_tokens=0
    )


class AdmissionGate:
    """Whether new Generate calls are admitted, and which admitted ones are still in flight.

    `closed_reason` is None while open. During a pause, `aborted` collects the requests whose streams ended
    with "abort" (what PauseGeneration reports back), each once.
    """

    def __init__(self) -> None:
        self.closed_reason: str | None = None
        self.in_flight: set[str] = set()
        self._aborted: list[str] | None = None

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    def open(self) -> None:
        self.closed_reason = None

    def started(self, request_id: str) -> None:
        self.in_flight.add(request_id)

    def ended(self, request_id: str, finish_reason: str | None) -> None:
        self.in_flight.discard(request_id)
        if finish_reason == "abort" and self._aborted is not None and request_id not in self._aborted:
            self._aborted.append(request_id)

    def watch_aborts(self) -> None:
        self._aborted = []

    def take_aborts(self) -> list[str]:
        aborted, self._aborted = self._aborted or [], None
        return aborted
