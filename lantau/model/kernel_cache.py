"""Compiled Triton kernels carried in an engine folder (`lantau build --compile-kernels`), so the
engine core on a fresh machine finds in Triton's cache what its warm-up would otherwise compile.

    FOLDER/kernels/<key>/
        KERNELS.json     the key's fields, the number of entries and files, when built
        <hash>/...       Triton cache entries as Triton wrote them (content-addressed folders;
                         their group files hold bare file names here, absolute paths in a cache)

The key names what compiled code depends on (GPU compute capability, Triton, torch and the CUDA
it was built with, lantau). The engine core copies the entries into Triton's cache directory only
under this machine's key, before its first compile. Triton still finds each kernel by a hash of
its source, options and target, so an entry nothing asks for is unused, never wrong. The kernels
are a cache: the manifest does not list them, and a folder without them loads as before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: no torch or triton at import: compile_kernels' child loads this first
    from lantau.model.source import ModelSource

logger = logging.getLogger(__name__)

KERNELS_DIR = "kernels"
KERNELS_INFO = "KERNELS.json"
GROUP_PREFIX = "__grp__"  # Triton's group file: {"child_paths": {file name: its path}}


@dataclass(frozen=True)
class KernelKey:
    """What compiled kernels depend on; `name` is their folder under kernels/."""

    gpu: str  # compute capability, "sm90"
    triton: str  # Triton's version
    torch: str  # torch's version
    cuda: str  # the CUDA version torch was built with
    lantau: str  # lantau's version (its kernels' source)

    @property
    def name(self) -> str:
        parts = [self.gpu, f"triton{self.triton}", f"torch{self.torch}", f"cuda{self.cuda}"]
        return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join([*parts, f"lantau{self.lantau}"]))


def machine_key(device: str = "cuda") -> KernelKey | None:
    """This machine's key for `device`; None without CUDA or Triton (nothing compiles)."""
    import torch

    if not torch.cuda.is_available():  # NOTE: checked first: a CPU engine imports no Triton
        return None
    try:
        import triton
    except ImportError:
        return None
    from lantau.model.build import lantau_version

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return KernelKey(
        f"sm{major}{minor}", triton.__version__, torch.__version__, str(torch.version.cuda),
        lantau_version(),
    )  # fmt: skip


def triton_cache_dir() -> Path:
    """Where Triton reads and writes compiled kernels: TRITON_CACHE_DIR, else
    $TRITON_HOME/.triton/cache (~/.triton/cache), as Triton's own knobs.cache.dir says."""
    from triton import knobs

    if not knobs.cache.dir:  # Triton itself would fail to compile anything
        raise OSError("Triton has no cache directory (TRITON_CACHE_DIR is empty)")
    return Path(knobs.cache.dir)


def _entries(folder: Path) -> list[Path]:
    """A cache's entries: its hash-named folders (no temporary or hidden ones)."""
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "tmp."))
    )


def _copy_entry(src: Path, dst: Path, final: Path | None) -> int:
    """Copy one entry's files; a group file's paths become bare names (final None: kept in an
    engine folder) or paths inside `final`, where the entry will live. Returns files copied."""
    dst.mkdir(parents=True)
    files = [p for p in src.iterdir() if p.is_file()]
    for path in files:
        if path.name.startswith(GROUP_PREFIX) and path.suffix == ".json":
            group = json.loads(path.read_text())
            group["child_paths"] = {
                name: str(final / Path(p).name) if final else Path(p).name
                for name, p in group.get("child_paths", {}).items()
            }
            (dst / path.name).write_text(json.dumps(group))
        else:
            shutil.copyfile(path, dst / path.name)
    return len(files)


def save_kernels(cache_dir: Path, folder: Path, key: KernelKey) -> dict:
    """Copy Triton's cache `cache_dir` into FOLDER/kernels/<key>/ (written under a temporary
    name, then renamed); returns its KERNELS.json."""
    final = folder / KERNELS_DIR / key.name
    tmp = folder / KERNELS_DIR / f".{key.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = _entries(cache_dir)
    num_files = sum(_copy_entry(e, tmp / e.name, None) for e in entries)
    info = {
        "key": asdict(key),
        "name": key.name,
        "num_entries": len(entries),
        "num_files": num_files,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / KERNELS_INFO).write_text(json.dumps(info, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return info


def seed_triton_cache(kernels: Path, cache_dir: Path) -> tuple[int, int]:
    """Copy each entry of `kernels` (FOLDER/kernels/<key>) that `cache_dir` lacks; returns
    (entries copied, entries already there)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    num_copied = num_present = 0
    for entry in _entries(kernels):
        target = cache_dir / entry.name
        if target.exists():
            num_present += 1
            continue
        # NOTE: copied under a temporary name, then renamed: a Triton reading the cache
        # meanwhile (another engine core) sees no entry or a whole one, never part of one
        tmp = cache_dir / f".{entry.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        _copy_entry(entry, tmp, target)
        try:
            os.rename(tmp, target)
            num_copied += 1
        except OSError:  # another process put it there first
            shutil.rmtree(tmp, ignore_errors=True)
            num_present += 1
    return num_copied, num_present


def seed_engine_kernels(source: ModelSource, device: str) -> dict[str, float]:
    """In the engine core, before its first Triton compile: Triton's cache seeded from the
    engine folder's kernels for this machine's key (`device`: the engine's, maybe "auto").
    Returns {"kernel_cache": seconds} (a start-up stage) when it had them, else {} with one
    INFO line saying why."""
    if source.kind != "engine" or device == "cpu":
        return {}
    key = machine_key("cuda" if device == "auto" else device)
    if key is None:  # no Triton or no GPU: nothing compiles
        return {}
    folder = source.path
    built = [p.name for p in _entries(folder / KERNELS_DIR)]
    if key.name not in built:
        has = f"has kernels for {', '.join(built)}" if built else "has no compiled kernels"
        logger.info("%s %s, this machine is %s; kernels compile at start-up", folder, has,
                    key.name)  # fmt: skip
        return {}
    start = time.perf_counter()
    try:
        cache_dir = triton_cache_dir()
        num_copied, num_present = seed_triton_cache(folder / KERNELS_DIR / key.name, cache_dir)
    except OSError as e:  # a cache: serving goes on, compiling what it lacks
        logger.warning("seeding Triton's cache from %s failed: %s", folder, e)
        return {}
    seconds = time.perf_counter() - start
    logger.info("Triton cache %s: %d compiled kernel entries copied from %s (%d already there), "
                "%.2f s", cache_dir, num_copied, folder / KERNELS_DIR / key.name, num_present,
                seconds)  # fmt: skip
    return {"kernel_cache": seconds}


def prehash_triton(device: str) -> threading.Thread | None:
    """In the engine core, as soon as its device is known: Triton's key for its cache, a hash of
    its own files (libtriton, ~400 MB), computed on a thread. Triton computes it once, at the
    first kernel's launch: the KV cache's sizing, on the start's critical path (0.7 s of its
    1.5 on an H200 from a cold disk, RESULTS.md 2026-12-06). The thread started (None on CPU)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton, or one that keys its cache otherwise
        return None
    thread = threading.Thread(target=triton_key, name="lantau-triton-key", daemon=True)
    thread.start()
    return thread


def check_can_compile_kernels() -> None:
    """`lantau build --compile-kernels`, before any work: it needs the GPU (and Triton) the
    folder will be served with."""
    from lantau.errors import ModelLoadError

    if machine_key() is None:
        raise ModelLoadError(
            "--compile-kernels compiles Triton kernels for the GPU the folder will be served "
            "on and needs that GPU here, but this machine has no CUDA GPU (or no triton): "
            "build without it, or on a machine with that GPU"
        )


def compile_kernels(folder: Path, engine_args: dict) -> dict:
    """Warm up the engine folder as `lantau serve` would (`engine_args`: serve's defaults) in
    a fresh process whose Triton cache is an empty folder, then keep that cache in
    FOLDER/kernels/<key>/; returns its KERNELS.json."""
    import gc
    import multiprocessing
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    import torch

    if torch.cuda.is_initialized():  # the build's weights freed: the KV cache sized as served
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="lantau-kernels-") as cache_dir:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            return pool.submit(_compile_kernels, str(folder), cache_dir, engine_args).result()


def _compile_kernels(folder: str, cache_dir: str, engine_args: dict) -> dict:
    """compile_kernels' child: Triton's cache pointed at `cache_dir` before Triton loads."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from lantau.engine import import_ahead
    from lantau.engine.args import build_engine_config
    from lantau.engine.core import EngineCore
    from lantau.engine.warmup import warm_up

    config, source = build_engine_config(folder, **{**engine_args, "device": "cuda"})
    core = EngineCore(config, source)
    warm_up(core)
    import_ahead.record()  # the files a served core's imports read, for its first start
    key = machine_key(core.config.device)
    assert key is not None  # check_can_compile_kernels passed in the parent
    return save_kernels(Path(cache_dir), Path(folder), key)


class CompileWatch:
    """Triton's compiles from install() on, through its JIT hooks: each a launch that waited,
    for the compile or for the variant's load from the disk cache (milliseconds). After the
    served core's warm-up, or inside a timed run, each one is a stall to name: a variant that
    start-up did not compile (RESULTS.md 2026-12-07: a decode kernel's variant for an eager
    step's block tables, +1.1 s in one mixed step). `on_compile(kernel, seconds, signature)`
    is called with each; `compiles` keeps (kernel, seconds). Needs triton (CUDA's JIT: the
    interpreter compiles nothing)."""

    def __init__(self, on_compile=None) -> None:
        self.on_compile = on_compile
        self.compiles: list[tuple[str, float]] = []
        self._started: dict[str, float] = {}
        self._before = None

    def install(self) -> CompileWatch:
        from triton import knobs

        rt = knobs.runtime
        self._before = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._start, self._end
        return self

    def uninstall(self) -> None:
        from triton import knobs

        if self._before is not None:
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before
            self._before = None

    def _start(self, *, key, **_) -> None:  # a true return would skip the compile
        self._started[str(key)] = time.perf_counter()

    def _end(self, *, key, repr, fn, **_) -> None:
        seconds = time.perf_counter() - self._started.pop(str(key), time.perf_counter())
        self.compiles.append((fn.name, seconds))
        if self.on_compile is not None:
            self.on_compile(fn.name, seconds, repr)

    def summary(self) -> dict:
        """{"compiles": n, "s": seconds in all, "kernels": {name: n}}."""
        total = round(sum(s for _, s in self.compiles), 3)
        kernels = dict(Counter(name for name, _ in self.compiles))
        return {"compiles": len(self.compiles), "s": total, "kernels": kernels}
