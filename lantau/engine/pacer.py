"""Late scheduling for a served engine (plain Python, no torch).

With overlapped steps the host schedules step N+1 the moment step N starts on the device, so
a request that arrives while N runs misses N+1 and starts in N+2: one whole step more of
time to first token. The pacer moves the schedule of N+1 to the latest moment that still
launches it before N ends: N's predicted end, less the host's schedule-to-launch time and a
safety margin. Requests arriving until then join N+1.

Predictions are per step shape (decode batch, or mixed step by its tokens, in the CUDA
graphs' buckets), an exponential average of exact samples only: a step's device time is
known when the host was already waiting for it at collect, and then it is the time from the
step's start (its launch, or its predecessor's end, whichever came later) to the wait's end.
When the host was late (the step had ended), the sample is an upper bound; the prediction
shrinks a little instead, so a too-long guess corrects itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

StepKey = tuple[int, int]


def step_key(num_requests: int, num_tokens: int) -> StepKey:
    """Decode steps by batch (8 a bucket), steps with prompt tokens by tokens (64 a bucket)."""
    if num_tokens == num_requests:
        return 0, -(-num_requests // 8)
    return 1, -(-num_tokens // 64)


@dataclass
class _Launched:
    key: StepKey
    launched_at: float


class StepPacer:
    def __init__(self, safety_s: float = 5e-4, alpha: float = 0.25, shrink: float = 0.95):
        self.safety_s, self.alpha, self.shrink = safety_s, alpha, shrink
        self.device_s: dict[StepKey, float] = {}  # predicted device time of a step shape
        self.host_s: float | None = None  # a step() call's time to its launch, averaged
        self._in_flight: deque[_Launched] = deque()  # launched, not collected, oldest first
        self._last_done = 0.0  # when the last collected step ended (as the host saw it)

    def launched(self, key: StepKey, step_started_at: float, launched_at: float) -> None:
        """A step was queued on the device; `step_started_at` is when the host began to
        schedule it."""
        sample = launched_at - step_started_at
        self.host_s = (
            sample if self.host_s is None else self.host_s + self.alpha * (sample - self.host_s)
        )
        self._in_flight.append(_Launched(key, launched_at))

    def collected(self, done_at: float, waited: bool) -> None:
        """The oldest step in flight was collected at `done_at`; `waited`: the host waited
        for it (so `done_at` is its end)."""
        step = self._in_flight.popleft()
        started = max(step.launched_at, self._last_done)
        self._last_done = done_at
        known = self.device_s.get(step.key)
        if waited:
            sample = done_at - started
            self.device_s[step.key] = (
                sample if known is None else known + self.alpha * (sample - known)
            )
        elif known is not None:
            self.device_s[step.key] = known * self.shrink

    def schedule_at(self) -> float | None:
        """When to schedule the next step: None for now (nothing or several steps in flight,
        or the one in flight of a shape not timed yet)."""
        if len(self._in_flight) != 1:
            return None
        step = self._in_flight[0]
        predicted = self.device_s.get(step.key)
        if predicted is None or self.host_s is None:
            return None
        started = max(step.launched_at, self._last_done)
        return started + predicted - self.host_s - self.safety_s
