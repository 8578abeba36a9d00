"""Llama-family model code and weight loaders."""
