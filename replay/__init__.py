"""Trajectory store, export and rewards."""
