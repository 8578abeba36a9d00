"""Turns scheduler outputs into tensors and runs the model."""
