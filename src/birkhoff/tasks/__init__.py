"""Verifiable tasks: problems, prompts, rewards, supervised batches."""
