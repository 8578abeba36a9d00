"""A model repository on disk, as Triton lays it out: REPO/NAME/config.pbtxt and
REPO/NAME/VERSION/ engine folders. Only what is complete counts: a version is a folder named by
a positive integer holding a manifest (`lantau build` writes it last)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lantau.model.manifest import is_engine_folder

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
CONTROL_MODES = ("none", "poll", "explicit")


@dataclass(frozen=True)
class RepositoryOptions:
    """`lantau serve --model-repository`'s options (here, not in model_control, so that the
    command reads them without importing the web stack)."""

    path: Path
    control_mode: str = "none"  # "none" | "poll" | "explicit" (Triton's flags)
    load_models: tuple[str, ...] = ()  # explicit mode: loaded at start
    poll_secs: float = 15.0


def bad_name_reason(name: str) -> str | None:
    """Why `name` cannot be a repository model's name (None: it can). No path separators,
    no `..`, nothing hidden: a name is one folder of the repository, never a path out of it."""
    if not name:
        return "empty"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if ".." in name:
        return "holds '..'"
    if not NAME_PATTERN.fullmatch(name) or len(name) > 200:
        return "must be letters, digits, '_', '-', '.', starting with a letter or digit"
    return None


def is_repository(folder: Path) -> bool:
    """A folder that looks like a repository rather than a model: no config.json or
    manifest of its own, and a subfolder holding a config.pbtxt or a version folder."""
    if (folder / "config.json").exists() or is_engine_folder(folder):
        return False
    for sub in folder.iterdir():
        if sub.is_dir() and (
            (sub / "config.pbtxt").exists() or any(v.name.isdigit() for v in sub.iterdir())
        ):
            return True
    return False


class ModelRepository:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such model repository folder")

    def model_names(self) -> list[str]:
        """Subfolders with a valid name (others are skipped, never served)."""
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and bad_name_reason(p.name) is None
        )

    def model_dir(self, name: str) -> Path:
        return self.root / name  # NOTE: callers check the name first (bad_name_reason)

    def versions(self, name: str) -> list[int]:
        """Complete versions (a manifest written), oldest first; half-written ones are not."""
        return self._versions(name, complete=True)

    def incomplete_versions(self, name: str) -> list[int]:
        """Version folders without a manifest (a build still writing, or one that failed)."""
        return self._versions(name, complete=False)

    def _versions(self, name: str, complete: bool) -> list[int]:
        folder = self.model_dir(name)
        if not folder.is_dir():
            return []
        return sorted(
            int(p.name)
            for p in folder.iterdir()
            if p.is_dir() and p.name.isdigit() and int(p.name) > 0
            and is_engine_folder(p) == complete
        )  # fmt: skip
