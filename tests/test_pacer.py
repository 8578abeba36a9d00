"""Late scheduling: the pacer's predictions from exact samples only, and the served core's
loop taking the requests that arrive before the predicted moment into the next step."""

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
from lantau.request import SamplingParams

DECODE = step_key(20, 20)


def test_step_keys_bucket_decodes_by_batch_and_mixed_steps_by_tokens():
    assert step_key(20, 20) == step_key(17, 17) == (0, 3)
    assert step_key(25, 25) == (0, 4)
    assert step_key(21, 255) == step_key(3, 200) == (1, 4)
    assert step_key(21, 257) == (1, 5)


def test_pacer_predicts_from_waited_collects_only():
    """Overlapped steps as the core runs them: A launched, then B launched while A runs, A
    collected, and so on; times in seconds."""
    pacer = StepPacer(safety_s=0.0005, alpha=0.5)
    assert pacer.schedule_at() is None  # nothing in flight
    pacer.launched(DECODE, 0.000, 0.001)  # host: 1 ms from step() to launch
    assert pacer.schedule_at() is None  # A's shape not timed yet
    pacer.launched(DECODE, 0.002, 0.003)
    assert pacer.schedule_at() is None  # two steps in flight
    pacer.collected(0.010, waited=True)  # A ran from its launch (0.001) to 0.010
    assert pacer.device_s[DECODE] == pytest.approx(0.009)
    # B started when A ended: due at 0.019, so schedule 1 ms (host) + 0.5 ms (safety) before
    assert pacer.schedule_at() == pytest.approx(0.0175)
    pacer.launched(DECODE, 0.0175, 0.0185)
    pacer.collected(0.0200, waited=True)  # B took 10 ms: the average moves half way
    assert pacer.device_s[DECODE] == pytest.approx(0.0095)
    # C was launched before B ended: it starts at B's end
    assert pacer.schedule_at() == pytest.approx(0.0200 + 0.0095 - 0.001 - 0.0005)
    pacer.launched(DECODE, 0.0290, 0.0300)
    pacer.collected(0.0310, waited=False)  # the host came late: C's time is unknown
    assert pacer.device_s[DECODE] == pytest.approx(0.0095 * pacer.shrink)
    pacer.launched(step_key(20, 300), 0.031, 0.032)
    pacer.collected(0.040, waited=True)
    assert pacer.schedule_at() is None  # a mixed step of a shape never timed


class FakeCore:
    """What the served loop touches of an EngineCore: one step in flight, due 0.3 s after
    the loop starts; step() records the requests it finds and stops the loop."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"model": "fake"})()
        self.has_unfinished_requests = True
        self.added: list[str] = []
        self.seen_at_step: list[str] | None = None
        self.due = time.monotonic() + 0.3

    def schedule_at(self) -> float:
        return self.due

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def step(self):
        self.seen_at_step = list(self.added)
        self.stepped_at = time.monotonic()
        raise StopIteration


def test_served_loop_takes_requests_until_the_step_is_due():
    """A request sent while the step in flight still runs joins the next step: the loop
    calls step() at the pacer's moment, not before, with the request already added."""
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
        _busy_loop(core, os.getppid(), pull, None)
    sender.join()
    assert core.seen_at_step == ["late"]
    assert core.stepped_at >= core.due
    push.close(0)
    pull.close(0)
    ctx.term()
