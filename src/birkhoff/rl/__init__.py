"""Reinforcement learning on verifiable tasks: tasks and rewards, advantages, losses, the loop."""
