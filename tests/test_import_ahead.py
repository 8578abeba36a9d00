"""The engine core's imports asked ahead: a start lists the files its imports read (mapped
libraries, module files) in the lantau cache once; the next start asks the kernel to read
each ahead (posix_fadvise WILLNEED) before importing torch; a package installed on the path
makes a new list; no cache, no list; a served core writes it, keyed alike in every process
of the interpreter."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys

import msgspec
import pytest

from lantau.engine import import_ahead
from lantau.engine.async_llm import AsyncLLM
from lantau.llm import build_engine_config
from lantau.model.source import load_tokenizer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LANTAU_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_record_lists_mapped_libraries_then_module_files_once(cache):
    import_ahead.record()
    entry = import_ahead._entry()
    paths = json.loads(entry.read_text())
    libs = [p for p in paths if ".so" in os.path.basename(p)]
    # a C extension this process has mapped (msgspec's), before the modules' files
    assert os.path.realpath(msgspec._core.__file__) in map(os.path.realpath, libs)
    assert paths[: len(libs)] == libs
    sizes = [os.path.getsize(p) for p in libs]
    assert sizes == sorted(sizes, reverse=True)  # the largest libraries asked first
    assert import_ahead.__file__ in paths
    pyc = importlib.util.cache_from_source(json.__file__)  # the bytecode beside the source
    assert pyc in paths or not os.path.isfile(pyc)
    entry.write_text("[]")  # once: a later start keeps the list it found
    import_ahead.record()
    assert entry.read_text() == "[]"


def test_start_advises_each_listed_file_and_passes_over_missing_ones(cache, tmp_path, monkeypatch):
    present = tmp_path / "lib.so"
    present.write_bytes(b"\0" * 8192)
    missing = tmp_path / "gone.so"
    entry = import_ahead._entry()
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps([str(present), str(missing)]))
    calls = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    thread = import_ahead.start()
    thread.join(10)
    assert calls == [(str(present), 0, 0, os.POSIX_FADV_WILLNEED)]


def test_a_package_installed_makes_a_new_list(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(import_ahead, "package_folders", lambda: [str(site)])
    before = import_ahead._entry()
    (site / "newpkg").mkdir()
    os.utime(site, ns=(os.stat(site).st_atime_ns, os.stat(site).st_mtime_ns + 10**9))
    assert import_ahead._entry() != before


def test_no_list_no_read_ahead(cache, monkeypatch):
    assert import_ahead.start() is None  # a first start
    entry = import_ahead._entry()
    entry.parent.mkdir(parents=True)
    entry.write_text("{not json")
    assert import_ahead.start() is None
    monkeypatch.setenv("LANTAU_CACHE_DIR", "off")
    import_ahead.record()
    assert import_ahead.start() is None and not any(cache.rglob("*.tmp"))


def test_a_served_core_lists_its_imports_for_the_next_start(cache):
    async def run() -> None:
        config, source = build_engine_config(
            "random:tiny", device="cpu", max_model_len=128, num_kv_blocks=32
        )
        engine = AsyncLLM(config, source, load_tokenizer(source))
        await engine.start()
        await engine.shutdown()

    asyncio.run(run())
    (entry,) = (cache / "imports").iterdir()
    assert entry == import_ahead._entry()  # this process's key: the build's compile shares it
    paths = json.loads(entry.read_text())
    # the core's own imports: torch's library and modules among them
    assert any(os.path.basename(p).startswith("libtorch") for p in paths)
    assert any(p.endswith(os.path.join("torch", "__init__.py")) for p in paths)
