"""Compiled kernels in an engine folder (lantau/model/kernel_cache.py), on CPU: the machine key,
a fabricated Triton cache kept in a folder and seeded into another cache (read back by Triton's
own cache manager), what is skipped, and `lantau build --compile-kernels` refused without a GPU.
The compile itself runs on the GPU (benchmarks/gpu_load.py --compile-kernels)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from lantau.cli import main
from lantau.model import kernel_cache
from lantau.model.kernel_cache import (
    KERNELS_DIR,
    KERNELS_INFO,
    KernelKey,
    machine_key,
    save_kernels,
    seed_engine_kernels,
    seed_triton_cache,
)
from lantau.model.source import ModelSource

KEY = KernelKey("sm90", "3.6.0", "2.9.1+cu128", "12.8", "0.1.0")
ENTRIES = ("ABCDEF234567", "QRSTUV765432")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def fake_triton_cache(cache, names=ENTRIES):
    """Entries as Triton's FileCacheManager writes them: a kernel's files and a group file
    naming them by absolute path."""
    for name in names:
        entry = cache / name
        entry.mkdir(parents=True)
        files = {"k.cubin": b"\x7fELF" + name.encode(), "k.json": b'{"name": "k"}'}
        for file, data in files.items():
            (entry / file).write_bytes(data)
        group = {"child_paths": {file: str(entry / file) for file in files}}
        (entry / "__grp__k.json").write_text(json.dumps(group))
    (cache / name / "tmp.pid_1_x").mkdir()  # a compile's leftover: never copied
    return cache


def test_key_names_a_safe_folder():
    assert KEY.name == "sm90-triton3.6.0-torch2.9.1_cu128-cuda12.8-lantau0.1.0"
    odd = KernelKey("sm90", "3.6/0 rc", "2.9", "12.8", "../x")
    assert "/" not in odd.name and " " not in odd.name


@no_cuda
def test_no_key_without_cuda_or_triton(monkeypatch):
    assert machine_key() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # an install without triton
    assert machine_key() is None


def test_round_trip_through_a_folder_into_a_cache_triton_reads(tmp_path, monkeypatch):
    folder = tmp_path / "repo" / "m" / "1"
    info = save_kernels(fake_triton_cache(tmp_path / "built"), folder, KEY)
    kept = folder / KERNELS_DIR / KEY.name
    assert info["num_entries"] == 2 and info["num_files"] == 6 and info["key"]["gpu"] == "sm90"
    assert json.loads((kept / KERNELS_INFO).read_text()) == info
    assert sorted(p.name for p in (folder / KERNELS_DIR).iterdir()) == [KEY.name]  # no temp
    group = json.loads((kept / ENTRIES[0] / "__grp__k.json").read_text())
    assert group["child_paths"] == {"k.cubin": "k.cubin", "k.json": "k.json"}  # no build paths
    assert not (kept / ENTRIES[1] / "tmp.pid_1_x").exists()

    cache = tmp_path / "fresh" / "cache"
    assert seed_triton_cache(kept, cache) == (2, 0)
    assert seed_triton_cache(kept, cache) == (0, 2)  # present entries are left alone
    assert sorted(p.name for p in cache.iterdir()) == sorted(ENTRIES)  # no temporary names
    triton_cache = pytest.importorskip("triton.runtime.cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    group = triton_cache.FileCacheManager(ENTRIES[0]).get_group("k.json")
    assert group == {f: str(cache / ENTRIES[0] / f) for f in ("k.cubin", "k.json")}
    assert (cache / ENTRIES[0] / "k.cubin").read_bytes() == b"\x7fELF" + ENTRIES[0].encode()


def test_seeding_keeps_what_the_cache_has(tmp_path):
    kept = fake_triton_cache(tmp_path / "kept")
    cache = tmp_path / "cache"
    (cache / ENTRIES[0]).mkdir(parents=True)
    (cache / ENTRIES[0] / "k.cubin").write_bytes(b"compiled here")
    assert seed_triton_cache(kept, cache) == (1, 1)
    assert (cache / ENTRIES[0] / "k.cubin").read_bytes() == b"compiled here"
    assert (cache / ENTRIES[1] / "k.cubin").is_file()


def engine_with_kernels(tmp_path, key: KernelKey) -> ModelSource:
    folder = tmp_path / "engine"
    save_kernels(fake_triton_cache(tmp_path / "built"), folder, key)
    return ModelSource("engine", folder, str(folder))


def test_the_engine_core_seeds_only_its_key(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setattr(kernel_cache, "triton_cache_dir", lambda: cache)
    monkeypatch.setattr(kernel_cache, "machine_key", lambda device="cuda": KEY)
    source = engine_with_kernels(tmp_path, KEY)
    assert seed_engine_kernels(source, "cpu") == {}  # the CPU compiles nothing
    assert seed_engine_kernels(ModelSource("random", None, "random:tiny"), "cuda") == {}
    assert not cache.exists()
    stages = seed_engine_kernels(source, "auto")
    assert list(stages) == ["kernel_cache"] and stages["kernel_cache"] >= 0
    assert sorted(p.name for p in cache.iterdir()) == sorted(ENTRIES)

    other = KernelKey("sm80", "3.6.0", "2.9.1+cu128", "12.8", "0.1.0")
    monkeypatch.setattr(kernel_cache, "machine_key", lambda device="cuda": other)
    cache2 = tmp_path / "cache2"
    monkeypatch.setattr(kernel_cache, "triton_cache_dir", lambda: cache2)
    with caplog.at_level(logging.INFO, logger="lantau.model.kernel_cache"):
        assert seed_engine_kernels(source, "cuda") == {}
    assert f"has kernels for {KEY.name}, this machine is {other.name}" in caplog.text
    assert not cache2.exists()


def test_no_kernels_or_no_triton_seeds_nothing(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "engine"
    folder.mkdir()
    source = ModelSource("engine", folder, str(folder))
    monkeypatch.setattr(kernel_cache, "machine_key", lambda device="cuda": KEY)
    with caplog.at_level(logging.INFO, logger="lantau.model.kernel_cache"):
        assert seed_engine_kernels(source, "cuda") == {}
    assert "has no compiled kernels" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)
    assert seed_engine_kernels(engine_with_kernels(tmp_path, KEY), "cuda") == {}


@no_cuda
def test_build_compile_kernels_needs_the_gpu(tmp_path, capsys):
    out = tmp_path / "repo" / "m" / "1"
    assert main(["build", "random:tiny", "--out", str(out), "--compile-kernels"]) == 1
    assert "--compile-kernels" in capsys.readouterr().err
    assert not out.exists()  # refused before any work


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(kernel_cache, "triton_cache_dir", lambda: blocked / "cache")
    monkeypatch.setattr(kernel_cache, "machine_key", lambda device="cuda": KEY)
    with caplog.at_level(logging.WARNING, logger="lantau.model.kernel_cache"):
        assert seed_engine_kernels(engine_with_kernels(tmp_path, KEY), "cuda") == {}
    assert "seeding Triton's cache" in caplog.text


def test_triton_hashed_on_a_thread_where_kernels_will_run(monkeypatch):
    """prehash_triton computes Triton's cache key (a hash of its own library) on a thread, the
    value Triton's first launch then takes from its cache; nothing on CPU."""
    import triton
    from triton.runtime.cache import triton_key

    assert kernel_cache.prehash_triton("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_cache.prehash_triton("auto") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_key.cache_clear()
    thread = kernel_cache.prehash_triton("cuda")
    thread.join(60)
    assert not thread.is_alive() and triton_key.cache_info().currsize == 1
    assert triton_key().startswith(triton.__version__)


COMPILE_TWICE = """
import json, logging, sys, time
import torch
import triton.language as tl
from triton import compiler, knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from lantau.engine.core_process import _log_late_compiles


def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


target = GPUTarget("cuda", 90, 32)
backend = compiler.make_backend(target)


def compile_once():
    jit = JITFunction(_add_one)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    kwargs = {"BLOCK": 8, "num_warps": 4}
    bound, spec, options = binder(torch.zeros(8), 8, **kwargs)
    key = compute_cache_key({}, spec, options)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, spec, options)
    jit.device_caches[0] = ({}, {}, target, backend, binder)
    jit.compile, jit.ASTSource = compiler.compile, compiler.ASTSource
    return jit._do_compile(key, signature, 0, constexprs, options, attrs, False).metadata.name


def earlier(**_):
    pass


logs = []
handler = logging.Handler()
handler.emit = lambda record: logs.append(record.getMessage())
logging.getLogger("lantau.engine.core_process").addHandler(handler)
knobs.runtime.jit_cache_hook = earlier
watch = _log_late_compiles()
names = [compile_once(), compile_once()]
watch.uninstall()
restored = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (earlier, None)
print(json.dumps({"names": names, "compiles": watch.compiles, "summary": watch.summary(),
                  "logs": logs, "restored": restored}))
"""


def test_compile_watch_times_each_triton_compile(tmp_path):
    """A real compile for sm90 on this CPU (triton ships ptxas) through Triton's own
    JITFunction._do_compile, as JITFunction.run calls it on a cache miss, with the target
    given instead of asked of a driver: the served core's watch (installed after its
    warm-up) names the kernel and the seconds the step waited, then a second JITFunction
    loads the same variant from the disk cache, timed too. Uninstalled, Triton's hooks are
    what they were. In a child without TRITON_INTERPRET: the interpreter leaves
    triton.language patched in a process where it ran a kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = tmp_path / "compile_twice.py"  # Triton reads a kernel's source from its file
    script.write_text(COMPILE_TWICE)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert all(name.startswith("_add_one") for name in got["names"])
    (first, compiled), (second, loaded) = got["compiles"]
    assert first == second == "_add_one"
    assert compiled > loaded > 0
    assert got["summary"] == {
        "compiles": 2,
        "s": round(compiled + loaded, 3),
        "kernels": {"_add_one": 2},
    }
    assert got["restored"]
    assert len(got["logs"]) == 2
    waited = f"a serving step waited {compiled:.3f} s for Triton to compile or load _add_one"
    assert got["logs"][0].startswith(waited)
    assert "_add_one[num_warps=4" in got["logs"][0]
