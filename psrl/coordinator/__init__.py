"""RolloutCoordinator: training code's client for weight syncs and stats pushes against the gateway.

It talks HTTP to the router and gRPC (ReplicaControl, GetLoads) to each replica at the address the replica
registered, so the trainer must reach every replica's gRPC port, and it needs the full install (grpcio and the
protobuf stubs), not `[client]`.
"""

from psrl.coordinator.coordinator import (
    BlockingRolloutCoordinator,
    ReplicaHandle,
    RolloutCoordinator,
    SyncError,
    SyncReport,
)

__all__ = ["BlockingRolloutCoordinator", "ReplicaHandle", "RolloutCoordinator", "SyncError", "SyncReport"]
