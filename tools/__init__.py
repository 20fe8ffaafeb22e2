"""Tool specs and their executors."""
