"""RolloutCoordinator: training code's client for weight syncs and stats pushes against the gateway.

It talks HTTP to the router and gRPC (ReplicaControl, GetLoads) to each replica at the address the replica
registered, so the trainer must reach every replica's gRPC port, and it needs the `[gateway]` install (grpcio and
the protobuf stubs), not the base `[client]` one. It can also drive the SessionRouter's thunder_agent strategy
(`session_strategy`).
"""

from psrl.coordinator.coordinator import (
    BlockingRolloutCoordinator,
    BlockingSessionStrategy,
    ReplicaHandle,
    RolloutCoordinator,
    SyncError,
    SyncReport,
)

__all__ = [
    "BlockingRolloutCoordinator",
    "BlockingSessionStrategy",
    "ReplicaHandle",
    "RolloutCoordinator",
    "SyncError",
    "SyncReport",
]
