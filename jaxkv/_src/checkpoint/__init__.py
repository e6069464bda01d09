"""Checkpoints: one file per store (npz), and orbax directories across processes."""
