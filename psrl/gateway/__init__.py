"""RolloutGateway: launches the router (and, with no replicas configured, the embedded default replicas).

`GatewayConfig` (psrl.gateway.config) imports no process code; `RolloutGateway` is loaded on first use."""

from typing import TYPE_CHECKING

from psrl.gateway.config import GatewayConfig

if TYPE_CHECKING:
    from psrl.gateway.launcher import RolloutGateway


def __getattr__(name: str) -> object:
    if name == "RolloutGateway":
        from psrl.gateway.launcher import RolloutGateway

        return RolloutGateway
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GatewayConfig", "RolloutGateway"]
