"""Named exceptions that cross lantau's boundaries."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or its sampling parameters are invalid; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(RuntimeError):
    """A model source could not be found, read or understood."""


class EngineStartError(RuntimeError):
    """An engine core could not start (its process said why: too little memory, a bad
    model, ...)."""
