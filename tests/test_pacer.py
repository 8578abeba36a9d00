"""Late scheduling: the pacer's predictions (CUDA-event device times per step shape, host
launch times per step kind, a start only from a step the host waited for), and the served
core's loop taking the requests that arrive before the predicted moment into the next step."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

from lantau.engine.core_process import _busy_loop
from lantau.engine.pacer import StepPacer, step_key
from lantau.engine.protocol import AddRequests, NewRequest
from lantau.metrics.gc_pauses import GcPauses
from lantau.request import SamplingParams
from tests.test_scheduler import add, make_scheduler

DECODE, MIXED = step_key(20, 20), step_key(21, 255)


def test_step_keys_bucket_decodes_by_batch_and_mixed_steps_by_tokens():
    assert step_key(20, 20) == step_key(17, 17) == (0, 3)
    assert step_key(25, 25) == (0, 4)
    assert step_key(21, 255) == step_key(3, 200) == (1, 4)
    assert step_key(21, 257) == (1, 5)


def test_pacer_predicts_the_end_of_the_step_in_flight():
    """Overlapped steps as the core runs them; times in seconds."""
    pacer = StepPacer(safety_s=0.0005, alpha=0.5)
    assert pacer.schedule_at(False) is None  # nothing in flight
    pacer.launched(DECODE, 0.001)  # the host took 1 ms from schedule to launch
    pacer.collected(0.010, waited=True, in_flight=DECODE)  # A ended at 10 ms, B queued
    assert pacer.schedule_at(False) is None  # B's shape not timed yet
    pacer.timed(DECODE, 0.008)  # A's events: 8 ms on the device
    # B started when A ended: due at 18 ms, so schedule 1 ms (host) + 0.5 ms (safety) before
    assert pacer.schedule_at(False) == pytest.approx(0.0165)
    assert pacer.schedule_at(True) is None  # a step with prompt tokens: its host time unknown
    pacer.launched(MIXED, 0.003)
    assert pacer.schedule_at(True) == pytest.approx(0.018 - 0.003 - 0.0005)
    pacer.timed(DECODE, 0.010)  # averages move half way
    assert pacer.device_s[DECODE] == pytest.approx(0.009)
    pacer.launched(DECODE, 0.002)
    assert pacer.host_s[False] == pytest.approx(0.0015)
    pacer.collected(0.030, waited=False, in_flight=DECODE)  # the host came late: start unknown
    assert pacer.schedule_at(False) is None
    pacer.collected(0.040, waited=True, in_flight=MIXED)  # a shape never timed
    assert pacer.schedule_at(False) is None
    pacer.collected(0.050, waited=True, in_flight=DECODE)
    assert pacer.schedule_at(False) == pytest.approx(0.050 + 0.009 - 0.0015 - 0.0005)
    pacer.forget()  # collected out of turn
    assert pacer.schedule_at(False) is None


def test_scheduler_knows_when_the_next_step_has_prompt_tokens():
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, "a", 4, max_tokens=5)
    assert not sched.has_partial_prompts  # waiting, not running
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and not sched.has_partial_prompts
    add(sched, "long", 12, max_tokens=2)
    sched.schedule()  # a's next token and 7 of long's 12
    assert sched.has_partial_prompts


class FakeCore:
    """What the served loop touches of an EngineCore: a step in flight due 0.4 s after the
    loop starts, or 0.25 s once a request arrived (its step takes the host longer to
    launch); step() records the requests it finds and stops the loop."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"model": "fake"})()
        self.has_unfinished_requests = True
        self.added: list[str] = []
        self.seen_at_step: list[str] | None = None
        now = time.monotonic()
        self.due, self.due_with_prompt = now + 0.4, now + 0.25

    def schedule_at(self, arrived: bool = False) -> float:
        return self.due_with_prompt if arrived else self.due

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def step(self):
        self.seen_at_step = list(self.added)
        self.stepped_at = time.monotonic()
        raise StopIteration


def test_served_loop_takes_requests_until_the_step_is_due():
    """A request sent while the step in flight still runs joins the next step: the loop
    calls step() at the pacer's moment for a step with prompt tokens, not before, with the
    request already added."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://in")
    push.connect("inproc://in")
    core = FakeCore()
    message = AddRequests([NewRequest("late", [1, 2, 3], SamplingParams(max_tokens=2), (0,), 0)])

    def send_later() -> None:
        time.sleep(0.1)
        push.send(msgspec.msgpack.encode(message))

    sender = threading.Thread(target=send_later)
    sender.start()
    with pytest.raises(StopIteration):
        _busy_loop(core, os.getppid(), pull, None, GcPauses())
    sender.join()
    assert core.seen_at_step == ["late"]
    assert core.due_with_prompt <= core.stepped_at < core.due
    push.close(0)
    pull.close(0)
    ctx.term()


def test_engine_core_keeps_the_pacer_in_step(monkeypatch):
    """The core's bookkeeping, run on CPU with stand-in timers (CUDA events there): every
    step launched is timed once collected, host times by step kind, and the tokens are
    those of an engine without it."""
    from lantau import LLM
    from lantau.engine import core as core_module

    timed: list[tuple] = []

    class FakeTimer:
        def stop(self) -> None:
            pass

        def time(self, pacer, key) -> None:
            timed.append(key)
            pacer.timed(key, 0.004)

    monkeypatch.setattr(core_module, "StepTimer", FakeTimer)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 40, [12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(paced: bool) -> list[list[int]]:
        llm = LLM("random:tiny", device="cpu", max_model_len=256, num_kv_blocks=64,
                  max_num_batched_tokens=64, long_prefill_token_threshold=48)  # fmt: skip
        if paced:
            llm.engine.core.pacer = StepPacer()
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
        if paced:
            pacer = llm.engine.core.pacer
            assert set(pacer.host_s) == {False, True} and pacer.device_s
        return outputs

    assert run(paced=True) == run(paced=False)
    assert len(timed) >= 6 and {k[0] for k in timed} == {0, 1}


def test_pacing_stops_when_requests_stop_arriving(monkeypatch):
    """With no request in the last PACE_WINDOW_S (a burst's tail), schedule_at() says "at
    once" although the pacer could predict; an arrival, or one within the window, paces again."""
    from lantau import LLM
    from lantau.engine import core as core_module

    llm = LLM("random:tiny", device="cpu", max_model_len=256, num_kv_blocks=64)
    core = llm.engine.core
    core.pacer = pacer = StepPacer(safety_s=0.0)
    pacer.launched(DECODE, 0.001)
    pacer.timed(DECODE, 0.008)
    now = [100.0]
    monkeypatch.setattr(core_module.time, "monotonic", lambda: now[0])
    pacer.collected(now[0], waited=True, in_flight=DECODE)
    due = now[0] + 0.008 - 0.001
    assert core.schedule_at() is None  # nothing ever arrived
    core.last_arrival_s = now[0] - core_module.PACE_WINDOW_S / 2
    assert core.schedule_at() == pytest.approx(due)
    now[0] += core_module.PACE_WINDOW_S  # the window has passed
    assert core.schedule_at() is None
    pacer.launched(MIXED, 0.002)
    assert core.schedule_at(arrived=True) == pytest.approx(due - 0.001)  # a step with prompts
    core.add_request(NewRequest("x", [1, 2, 3], SamplingParams(max_tokens=2), (0,), 0).to_request())
    assert core.last_arrival_s == now[0]
