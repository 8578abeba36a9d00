"""Triton kernels for the hot path, each beside its launcher; their torch references in
reference.py. Importing this package (or reference.py) imports no Triton."""

from __future__ import annotations


def require_triton(why: str) -> None:
    """Raise at start-up, naming the package, when Triton is needed (`why`) and missing: never
    at the first request."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{why} needs the `triton` package, which is not installed: `pip install triton` "
            "(or run on CPU with the torch backend)"
        ) from e
