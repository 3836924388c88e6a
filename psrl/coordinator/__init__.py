"""RolloutCoordinator: training code's client for weight syncs and stats pushes against the gateway."""

from psrl.coordinator.coordinator import (
    BlockingRolloutCoordinator,
    ReplicaHandle,
    RolloutCoordinator,
    SyncError,
    SyncReport,
)

__all__ = ["BlockingRolloutCoordinator", "ReplicaHandle", "RolloutCoordinator", "SyncError", "SyncReport"]
