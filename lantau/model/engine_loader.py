"""Loading an engine folder (`lantau build`'s output) into a built model: the shards read in
parallel, each byte read once, straight into the parameters (on CUDA through two pinned staging
buffers per thread), hashed as it passes, checked against the manifest.

A shard is hashed once per state of its file, as git's index does: after a load has hashed it
and found the manifest's sha256, a stamp in the cache (LANTAU_CACHE_DIR/verified/) records the
file's identity and times (device, inode, size, mtime and ctime in ns), and a later load of the
same unchanged file skips the hash. Any write to a file moves its ctime, which no process can
set back, so a changed shard is hashed again and a changed byte is still a checksum mismatch. A
stamp is written only for a file whose ctime was over STAMP_MIN_AGE_S old when the hash began and
that did not change while it was hashed: a write in the same tick of the file system's clock
could otherwise leave its times as stamped. LANTAU_CACHE_DIR=off hashes every load.

A shard is a safetensors file: an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and [begin, end) in the data), then the data, tensors back to back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from lantau import envs
from lantau.errors import ModelLoadError
from lantau.model.manifest import Manifest, TensorSpec, check_layout

STAGING_BYTES = 32 << 20  # each of a thread's two pinned staging buffers, on CUDA
PIECE_BYTES = 256 << 20  # a job's bytes, where a shard is not hashed
STAMP_MIN_AGE_S = 2.0  # well over any file system's timestamp tick


def engine_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an engine folder stores: every parameter (a tied one once) and persistent buffer
    (fp8 scales, should a quantized model keep them as buffers)."""
    tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if leaf not in module._non_persistent_buffers_set:
            tensors[name] = buffer
    return tensors


def tensor_specs(model: torch.nn.Module) -> dict[str, TensorSpec]:
    """The model's tensors as an engine folder stores them."""
    return {
        name: TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in engine_tensors(model).items()
    }


def load_engine_weights(
    model: torch.nn.Module,
    folder: Path,
    manifest: Manifest,
    *,
    verify_checksums: bool = True,
    num_threads: int | None = None,
    synchronize: bool = True,
) -> None:
    """Fill every parameter of `model` from the folder's shards, its rank's (ModelLoadError on
    any mismatch: tensor-parallel size, layout, size, checksum). Each tensor's copies are done
    when this returns. `synchronize`: first wait for the device's queued work (kernels that
    write the parameters); a caller on another thread does that itself, before it starts
    this.

    A shard to hash is one thread's job, read in order (its hash runs over the file); a shard
    hashed before (or with verify_checksums off) is cut into pieces of about PIECE_BYTES that
    any thread takes, so the threads finish together: with whole shards as jobs, 18 shards on
    16 threads left two threads reading the last two alone."""
    tp = model.tp
    if manifest.tensor_parallel_size != tp.size:
        raise ModelLoadError(
            f"{folder}: built for tensor-parallel size {manifest.tensor_parallel_size}, loading "
            f"on {tp.size}: serve it with --tensor-parallel-size {manifest.tensor_parallel_size} "
            f"or rebuild it with `lantau build {manifest.source} --tensor-parallel-size {tp.size}`"
        )
    check_layout(folder, manifest, tensor_specs(model))
    params = engine_tensors(model)
    device = next(iter(params.values())).device
    plans = [
        _plan_shard(folder / shard, manifest.files[shard]["sha256"], params, verify_checksums)
        for shard in manifest.shards_of(tp.rank)  # this rank's slice
    ]
    jobs = [functools.partial(_load_hashed, plan) for plan in plans if plan.hash]
    for plan in plans:
        if not plan.hash:
            jobs += [functools.partial(_load_piece, plan.path, *p) for p in plan.pieces()]
    num_threads = num_threads or min(len(jobs), os.cpu_count() or 1, 16)
    if device.type == "cuda" and synchronize:
        torch.cuda.synchronize(device)
    local = threading.local()  # each thread's reader
    readers: list[_Reader] = []

    def run(job) -> None:
        if not hasattr(local, "reader"):
            local.reader = _Reader(device)
            readers.append(local.reader)  # NOTE: list.append is atomic
        job(local.reader)

    try:
        with torch.no_grad(), ThreadPoolExecutor(max(1, num_threads)) as pool:
            list(pool.map(run, jobs))
    finally:
        for reader in readers:
            reader.finish()


class _ShardPlan(NamedTuple):
    """A shard's tensors in file order, checked against the model: (destination bytes, file
    offset) each; `hash`: whether this load hashes it (the stamp's inputs beside)."""

    path: Path
    sha256: str
    head: bytes  # the length and JSON header, hashed first
    tensors: list[tuple[torch.Tensor, int]]
    hash: bool
    identity: dict[str, int]
    began: float

    def pieces(self):
        """(destination, file offset) pieces of at most PIECE_BYTES, in file order."""
        for dst, offset in self.tensors:
            for start in range(0, max(dst.numel(), 1), PIECE_BYTES):
                yield dst[start : start + PIECE_BYTES], offset + start


def _read_header(f, path: Path) -> tuple[bytes, dict]:
    head = f.read(8)
    if len(head) != 8:
        raise ModelLoadError(f"{path}: truncated safetensors file")
    (size,) = struct.unpack("<Q", head)
    raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return head + raw, header


def _plan_shard(
    path: Path, sha256: str, params: dict[str, torch.Tensor], verify: bool
) -> _ShardPlan:
    """Read a shard's header and check it: tensors tiling its data section in offset order,
    each the size of its parameter, nothing after the last."""
    with open(path, "rb", buffering=0) as f:
        began, identity = time.time(), _identity(os.fstat(f.fileno()))
        head, header = _read_header(f, path)
    stamp = _stamp_path(path) if verify else None
    if stamp is not None and _stamped(stamp, sha256, identity):
        verify = False  # hashed before, unchanged since
    tensors, position = [], 0  # in the data section: tensors must tile it, in offset order
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = entry["data_offsets"]
        param = params.get(name)
        if param is None or begin != position:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} at byte {begin}")
        dst = param.detach().view(-1).view(torch.uint8)  # [numel * itemsize] bytes
        if dst.numel() != end - begin:
            raise ModelLoadError(f"{path}: {name} holds {end - begin} bytes, expected "
                                 f"{dst.numel()}")  # fmt: skip
        tensors.append((dst, len(head) + begin))
        position = end
    if len(head) + position != identity["size"]:
        what = "truncated" if len(head) + position > identity["size"] else "bytes after the last"
        raise ModelLoadError(f"{path}: {what} tensor")
    return _ShardPlan(path, sha256, head, tensors, verify, identity, began)


def _load_hashed(plan: _ShardPlan, reader: _Reader) -> None:
    """A shard read whole, in order, hashed as it passes; a match stamps it."""
    hasher = hashlib.sha256(plan.head)
    with open(plan.path, "rb", buffering=0) as f:
        for dst, offset in plan.tensors:
            reader.read(f.fileno(), offset, dst, plan.path, hasher)
    if hasher.hexdigest() != plan.sha256:
        raise ModelLoadError(
            f"{plan.path}: checksum mismatch (sha256 {hasher.hexdigest()[:12]}, the manifest "
            f"says {plan.sha256[:12]}): the file is corrupt or changed after the build; rebuild "
            "this folder"
        )
    stamp = _stamp_path(plan.path)
    if stamp is not None:
        after = _identity(plan.path.stat())
        old = plan.began - plan.identity["ctime_ns"] / 1e9 > STAMP_MIN_AGE_S
        if after == plan.identity and old:
            _write_stamp(stamp, {"sha256": plan.sha256, **plan.identity})


def _load_piece(path: Path, dst: torch.Tensor, offset: int, reader: _Reader) -> None:
    with open(path, "rb", buffering=0) as f:
        reader.read(f.fileno(), offset, dst, path)


def _identity(st: os.stat_result) -> dict[str, int]:
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}  # fmt: skip


def _stamp_path(path: Path) -> Path | None:
    entry = envs.cache_entry("verified", str(path.resolve()))
    return entry and entry.with_suffix(".json")


def _stamped(stamp: Path, sha256: str, identity: dict[str, int]) -> bool:
    try:
        return json.loads(stamp.read_text()) == {"sha256": sha256, **identity}
    except (OSError, ValueError):
        return False


def _write_stamp(stamp: Path, record: dict) -> None:
    """Best effort: a cache that cannot be written (read-only home) only costs the next load
    its hash."""
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, stamp)
    except OSError:
        pass


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill view with the file's bytes from offset (os.preadv releases the GIL)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise ModelLoadError(f"{path}: truncated")
        done += n


class _Reader:
    """One loading thread's reads: on the CPU straight into the parameter; on CUDA through two
    pinned staging buffers, a chunk read into one while the other's copy to the device runs on
    the thread's stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type != "cuda":
            return
        self.staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]  # fmt: skip
        self.views = [memoryview(b.numpy()) for b in self.staging]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy
        self.stream = torch.cuda.Stream(device)
        self.turn = 0

    def read(self, fd: int, offset: int, dst: torch.Tensor, path: Path, hasher=None) -> None:
        """dst (a uint8 view of a parameter) from the file's bytes at offset, hashed in order
        when a hasher is given."""
        if self.device.type != "cuda":
            view = memoryview(dst.numpy())  # the parameter's own memory
            _pread_into(fd, view, offset, path)
            if hasher is not None:
                hasher.update(view)  # NOTE: hashlib releases the GIL on large buffers
            return
        for start in range(0, dst.numel(), STAGING_BYTES):
            size = min(STAGING_BYTES, dst.numel() - start)
            i, self.turn = self.turn, self.turn ^ 1
            if self.copied[i] is not None:
                self.copied[i].synchronize()  # its last copy to the device is done
            _pread_into(fd, self.views[i][:size], offset + start, path)
            if hasher is not None:
                hasher.update(self.views[i][:size])
            with torch.cuda.stream(self.stream):
                dst[start : start + size].copy_(self.staging[i][:size], non_blocking=True)
                self.copied[i] = torch.cuda.Event()
                self.copied[i].record(self.stream)

    def finish(self) -> None:
        if self.device.type == "cuda":
            self.stream.synchronize()
