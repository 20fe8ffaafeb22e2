"""Chat-bot backends: platforms' wire formats, pure (no I/O)."""
