"""The engine core's imports asked ahead of time from a cold page cache.

`import torch` reads its libraries one page fault at a time and its modules one file at a
time: on a fresh machine (the H200's serve-repo-ready, whole page cache dropped) that took 4.2 s
of a 16 s start. The core therefore starts, before importing torch, a thread that asks the
kernel to read ahead (posix_fadvise WILLNEED: the reads are queued, nothing waits on them)
every file the last start on this interpreter read: the shared libraries it had mapped
(largest first) and its modules' files, listed once after a start-up in the lantau cache
(envs.cache_entry "imports", keyed by the interpreter and its site-packages' times: a package
installed or removed there makes a new list). `lantau build --compile-kernels` writes it too,
so the first serve of a folder built here has it; a first start with no list reads as before.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import sysconfig
import threading
from pathlib import Path

from lantau import envs


def package_folders() -> list[str]:
    """The interpreter's site-packages (where torch and its libraries live)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def _entry() -> Path | None:
    """One list per interpreter and package set: any process of it shares it (the build's
    kernel compile writes it for the first serve), a package installed or removed makes a
    new one (the folder's time changes)."""
    folders = []
    for folder in package_folders():
        try:
            folders.append([folder, os.stat(folder).st_mtime_ns])
        except OSError:
            continue
    return envs.cache_entry("imports", json.dumps([sys.executable, sys.version, folders]))


def loaded_files() -> tuple[list[str], list[str]]:
    """The shared libraries this process maps, largest first, and every loaded module's
    source and bytecode files."""
    sizes: dict[str, int] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if ".so" in path and path not in sizes and os.path.isfile(path):
                    sizes[path] = os.path.getsize(path)
    except OSError:  # not Linux
        pass
    modules: set[str] = set()
    for module in list(sys.modules.values()):
        src = getattr(module, "__file__", None)
        if not isinstance(src, str) or src in sizes or not os.path.isfile(src):
            continue
        modules.add(src)
        if src.endswith(".py"):
            pyc = importlib.util.cache_from_source(src)
            if os.path.isfile(pyc):
                modules.add(pyc)
    return sorted(sizes, key=sizes.__getitem__, reverse=True), sorted(modules)


def advise(paths: list, advice: int | None = None) -> int:
    """posix_fadvise each whole file (WILLNEED, the default: read it ahead; DONTNEED: drop
    its cached pages); files gone or unreadable are passed over. The bytes advised."""
    advice = os.POSIX_FADV_WILLNEED if advice is None else advice
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
            total += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def start() -> threading.Thread | None:
    """The read-ahead of the last start's files on a thread; None without a list."""
    entry = _entry()
    if entry is None or not hasattr(os, "posix_fadvise"):
        return None
    try:
        paths = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    thread = threading.Thread(target=advise, args=(paths,), name="import-ahead", daemon=True)
    thread.start()
    return thread


def record() -> None:
    """List this process's files for the next start, libraries first, once (the first start
    after an install writes a new entry: the key holds the site-packages' times)."""
    entry = _entry()
    if entry is None or entry.exists():
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        libraries, modules = loaded_files()
        tmp.write_text(json.dumps(libraries + modules))
        os.replace(tmp, entry)
    except OSError:  # a read-only cache: no list, no read-ahead
        pass
