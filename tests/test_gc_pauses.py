"""The served processes' garbage collector (lantau/metrics/gc_pauses.py): start-up's objects
frozen out of every collection's walk, each collection timed by generation, and the cycles of
a released (unloaded) version's frozen objects still collected; an in-process (offline)
engine's heap frozen only while it has requests. In-process, on the real gc."""

from __future__ import annotations

import gc
import weakref

import pytest

from lantau.metrics.gc_pauses import FrozenWhileBusy, GcPauses, ProcessGc, freeze_startup_heap


@pytest.fixture
def thawed():
    """Leave the test process's collector as it was: nothing frozen, no callback of ours."""
    callbacks = list(gc.callbacks)
    yield
    gc.callbacks[:] = callbacks
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_takes_the_heap_out_of_full_collections(thawed):
    tracked = len(gc.get_objects())
    frozen = freeze_startup_heap()
    # frozen objects can still die by reference count (another thread's), never be added
    assert frozen >= tracked // 2 and frozen - 1_000 <= gc.get_freeze_count() <= frozen
    # a full collection now walks only what was made since: none of the frozen objects
    assert len(gc.get_objects()) < tracked // 10


def test_pauses_are_timed_by_generation(thawed):
    pauses = GcPauses().install()
    gc.collect(0)
    gc.collect(2)
    got = pauses.drain()
    assert [g for g, _ in got] == [0, 2] and all(s > 0 for _, s in got)
    assert pauses.drain() == []
    pauses.uninstall()
    gc.collect(0)
    assert pauses.drain() == []
    seen = []
    GcPauses(lambda g, s: seen.append((g, s))).install()
    gc.collect(1)
    assert [g for g, _ in seen] == [1] and seen[0][1] > 0


def test_process_gc_observes_its_pauses_and_frees_released_cycles(thawed):
    node = Node()
    ref = weakref.ref(node)
    process = ProcessGc()
    process.start()
    assert process.started and process.frozen > 0
    assert process.histograms[2].count == 1  # the start-up heap's collection, before its freeze
    del node  # released after the freeze: its cycle is frozen, no collection frees it
    gc.collect()
    assert ref() is not None
    counts = {g: h.count for g, h in process.histograms.items()}
    process.collect_released()  # as after a repository's version unloads
    assert ref() is None
    assert process.histograms[2].count >= counts[2] + 1  # that collection, timed
    assert gc.get_freeze_count() > 0  # and the rest frozen again
    process.stop()
    stopped = process.histograms[0].count
    gc.collect(0)
    assert process.histograms[0].count == stopped


def test_frozen_while_busy_thaws_when_idle_also_over_an_earlier_freeze(thawed):
    node = Node()
    ref = weakref.ref(node)
    held = FrozenWhileBusy()
    held.track(busy=True)
    assert gc.get_freeze_count() > 0
    del node  # garbage while frozen: no collection frees its cycle
    gc.collect()
    assert ref() is not None
    held.track(busy=False)
    assert gc.get_freeze_count() == 0
    gc.collect()  # thawed: the cycle is collected after all
    assert ref() is None
    # a heap someone froze first (the GPU image's interpreter does): what was made since is
    # frozen too while busy, and all of it thawed when idle (a dropped engine's cycles freed)
    frozen = freeze_startup_heap()
    since = Node()
    since_ref = weakref.ref(since)
    assert any(o is since for o in gc.get_objects())
    held.track(busy=True)
    assert gc.get_freeze_count() > frozen and not any(o is since for o in gc.get_objects())
    del since
    held.track(busy=False)
    assert not held.frozen and gc.get_freeze_count() == 0
    gc.collect()
    assert since_ref() is None


def test_offline_engine_freezes_its_heap_only_while_it_has_requests(thawed):
    """LLM.generate's steps run with the heap as it stood at the first step frozen (start-up's
    objects and every queued request: out of the full collections' walks), and leave nothing
    frozen when done, failed or not."""
    from lantau import LLM, SamplingParams

    llm = LLM("random:tiny", max_num_seqs=4, max_model_len=256)
    core_step = llm.engine.core.step
    seen = []

    def step():
        seen.append((gc.get_freeze_count(), marker_walked()))
        return core_step()

    llm.engine.core.step = step
    marker = ["made before the run"]
    marker_id = id(marker)

    def marker_walked() -> bool:
        return any(id(o) == marker_id for o in gc.get_objects())

    assert marker_walked() and gc.get_freeze_count() == 0
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 6, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 6
    assert len(seen) >= 3 and all(count > 0 and not walked for count, walked in seen)
    assert gc.get_freeze_count() == 0 and marker_walked()

    def failing_step():
        raise RuntimeError("the device went away")

    llm.engine.core.step = failing_step
    with pytest.raises(RuntimeError):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert gc.get_freeze_count() == 0 and not llm.engine.has_unfinished_requests
