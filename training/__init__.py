"""Replay-train: datasets, LoRA training, evaluation and the adapter registry."""
