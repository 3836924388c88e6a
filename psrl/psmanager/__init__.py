"""PSManager: PSRL's staleness/reservation bookkeeping (pure logic), its gRPC service and a typed async client."""

from psrl.psmanager.errors import InvalidArgument, PSManagerError, PSManagerUnavailable, UnknownBuffer
from psrl.psmanager.state import PSManagerConfig, PSManagerState, RequestRecord, RequestStatus, ReserveResult

__all__ = [
    "InvalidArgument",
    "PSManagerConfig",
    "PSManagerError",
    "PSManagerState",
    "PSManagerUnavailable",
    "RequestRecord",
    "RequestStatus",
    "ReserveResult",
    "UnknownBuffer",
]
