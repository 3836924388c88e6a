"""psrl-gateway: rollout gateway for RL post-training."""
