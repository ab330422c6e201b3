"""Reinforcement learning on verifiable tasks (birkhoff.tasks): advantages, GRPO loss, rollouts,
the GRPO run."""
