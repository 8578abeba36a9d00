"""Triton kernels for the hot path, each beside its launcher and torch reference."""
