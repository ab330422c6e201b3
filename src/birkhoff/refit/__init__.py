"""Refit: stream trainer weights into the engine in buckets, one completeness check, atomic commit."""
