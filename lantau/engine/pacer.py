"""Late scheduling for a served engine (plain Python, no torch).

With overlapped steps the host schedules step N+1 the moment it has launched step N, so a
request that arrives while N runs misses N+1 and starts in N+2: one whole step more of time
to first token. The pacer moves the schedule of N+1 to the latest moment that still launches
it before N ends: N's predicted end, less the host's schedule-to-launch time for the kind of
step N+1 will be (one with prompt tokens costs the host more) and a safety margin. The served
loop takes requests until then, so those arriving while N runs join N+1.

A prediction needs two things:
- when N started on the device: the end of the step before it, as the host saw it when it
  waited for that step's tokens (a host that came late saw only that the step had ended,
  not when: N is then not paced, and the next step sets the clock again);
- how long N takes: each step's device time, measured by CUDA events around it (exact
  whether or not the host waited), averaged per step shape (decode batch, or tokens of a
  step with prompt tokens, in the CUDA graphs' buckets).
"""

from __future__ import annotations

StepKey = tuple[int, int]


def step_key(num_requests: int, num_tokens: int) -> StepKey:
    """Decode steps by batch (8 a bucket), steps with prompt tokens by tokens (64 a bucket)."""
    if num_tokens == num_requests:
        return 0, -(-num_requests // 8)
    return 1, -(-num_tokens // 64)


class StepPacer:
    def __init__(self, safety_s: float = 3e-4, alpha: float = 0.25) -> None:
        self.safety_s, self.alpha = safety_s, alpha
        self.device_s: dict[StepKey, float] = {}  # a step shape's device time, averaged
        # schedule-to-launch host time by whether the step has prompt tokens, averaged
        self.host_s: dict[bool, float] = {}
        self.in_flight: StepKey | None = None  # the step on the device, not collected yet
        self.started_at: float | None = None  # when it started there (None: unknown)

    def _average(self, table: dict, key, sample: float) -> None:
        known = table.get(key)
        table[key] = sample if known is None else known + self.alpha * (sample - known)

    def launched(self, key: StepKey, host_s: float) -> None:
        """A step of shape `key` was queued, `host_s` after the host began scheduling it."""
        self._average(self.host_s, key[0] == 1, host_s)

    def timed(self, key: StepKey, device_s: float) -> None:
        """A collected step's device time (its CUDA events)."""
        self._average(self.device_s, key, device_s)

    def collected(self, done_at: float, waited: bool, in_flight: StepKey | None) -> None:
        """The step before `in_flight` was collected at `done_at`; `waited`: the host waited
        for it, so it ended then and `in_flight` (queued behind it) started then."""
        self.in_flight = in_flight
        self.started_at = done_at if waited and in_flight is not None else None

    def forget(self) -> None:
        """The step in flight was collected out of turn: nothing to pace against."""
        self.in_flight = self.started_at = None

    def schedule_at(self, with_prompt: bool) -> float | None:
        """When to schedule the next step (with prompt tokens or not) so that it is queued
        just before the step in flight ends; None: at once (nothing timed to go by)."""
        if self.in_flight is None or self.started_at is None:
            return None
        device = self.device_s.get(self.in_flight)
        host = self.host_s.get(with_prompt)
        if device is None or host is None:
            return None
        return self.started_at + device - host - self.safety_s
