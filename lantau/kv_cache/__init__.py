"""Paged KV cache bookkeeping (no torch)."""
