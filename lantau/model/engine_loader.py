"""Loading an engine folder (`lantau build`'s output) into a built model: the shards read in
parallel, each byte read once, straight into the parameters (on CUDA through a pinned staging
buffer per thread), hashed as it passes, checked against the manifest.

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

import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lantau import envs
from lantau.errors import ModelLoadError
from lantau.model.manifest import Manifest, TensorSpec, check_layout

STAGING_BYTES = 64 << 20  # per thread, pinned, on CUDA
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
    this."""
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
    shards = manifest.shards_of(tp.rank)  # this rank's slice
    num_threads = num_threads or min(len(shards), os.cpu_count() or 1, 16)
    if device.type == "cuda" and synchronize:
        torch.cuda.synchronize(device)
    local = threading.local()  # each thread's staging buffer and stream (CUDA)

    def load(shard: str) -> None:
        _load_shard(folder / shard, manifest.files[shard]["sha256"], params, device, local,
                    verify_checksums)  # fmt: skip

    with torch.no_grad(), ThreadPoolExecutor(max(1, num_threads)) as pool:
        list(pool.map(load, shards))


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


def _load_shard(
    path: Path,
    sha256: str,
    params: dict[str, torch.Tensor],
    device: torch.device,
    local: threading.local,
    verify: bool,
) -> None:
    with open(path, "rb", buffering=0) as f:
        began, before = time.time(), _identity(os.fstat(f.fileno()))
        stamp = _stamp_path(path) if verify else None
        if stamp is not None and _stamped(stamp, sha256, before):
            verify = False  # hashed before, unchanged since
        hasher = hashlib.sha256() if verify else None
        head, header = _read_header(f, path)
        if hasher is not None:
            hasher.update(head)
        position = 0  # in the data section: tensors must tile it, in offset order
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            param = params.get(name)
            if param is None or begin != position:
                raise ModelLoadError(f"{path}: unexpected tensor {name!r} at byte {begin}")
            dst = param.detach().view(-1).view(torch.uint8)  # [numel * itemsize] bytes
            if dst.numel() != end - begin:
                raise ModelLoadError(f"{path}: {name} holds {end - begin} bytes, expected "
                                     f"{dst.numel()}")  # fmt: skip
            _read_into(f, dst, device, local, hasher, path)
            position = end
        if f.read(1):
            raise ModelLoadError(f"{path}: bytes after the last tensor")
    if hasher is not None and hasher.hexdigest() != sha256:
        raise ModelLoadError(
            f"{path}: checksum mismatch (sha256 {hasher.hexdigest()[:12]}, the manifest says "
            f"{sha256[:12]}): the file is corrupt or changed after the build; rebuild this "
            "folder"
        )
    if hasher is not None and stamp is not None:
        after = _identity(path.stat())
        if after == before and began - before["ctime_ns"] / 1e9 > STAMP_MIN_AGE_S:
            _write_stamp(stamp, {"sha256": sha256, **before})


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


def _read_into(f, dst: torch.Tensor, device, local, hasher, path: Path) -> None:
    """Read len(dst) bytes of f into dst (a uint8 view of a parameter), hashing them."""
    if device.type != "cuda":
        view = memoryview(dst.numpy())  # the parameter's own memory
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ModelLoadError(f"{path}: truncated")
            done += n
        if hasher is not None:
            hasher.update(view)  # NOTE: hashlib releases the GIL on large buffers
        return
    if not hasattr(local, "staging"):
        local.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        local.stream = torch.cuda.Stream(device)
    staging, view = local.staging, memoryview(local.staging.numpy())
    for start in range(0, dst.numel(), STAGING_BYTES):
        size = min(STAGING_BYTES, dst.numel() - start)
        local.stream.synchronize()  # the last copy out of the staging buffer is done
        done = 0
        while done < size:
            n = f.readinto(view[done:size])
            if not n:
                raise ModelLoadError(f"{path}: truncated")
            done += n
        if hasher is not None:
            hasher.update(view[:size])
        with torch.cuda.stream(local.stream):
            dst[start : start + size].copy_(staging[:size], non_blocking=True)
    local.stream.synchronize()
