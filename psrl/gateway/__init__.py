"""RolloutGateway: launches the router (and, with no replicas configured, the embedded default replicas)."""

from psrl.gateway.launcher import GatewayConfig, RolloutGateway

__all__ = ["GatewayConfig", "RolloutGateway"]
