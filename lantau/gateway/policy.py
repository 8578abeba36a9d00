"""Which replica a request goes to: the gateway's backends as plain state and the routing
policies over them (plain Python: no I/O, no clock, so each is tested exactly)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from lantau.metrics.stats import LATENCY_BUCKETS, Histogram


@dataclass(eq=False)
class Backend:
    """One replica (a `lantau serve`, or any OpenAI-compatible server) as the gateway sees it."""

    url: str  # base URL without a trailing slash, e.g. http://10.0.0.5:8000
    # the name its TLS certificate carries where the URL holds an address (a DNS-found one's)
    tls_name: str | None = None
    is_healthy: bool = False  # its last health check, or the last call through it, succeeded
    is_draining: bool = False  # takes no new requests (being removed, or its operator said so)
    num_in_flight: int = 0  # requests this gateway has open on it now
    # what the replica itself counted in flight at the last check (a `lantau serve`'s /status:
    # every client's requests, other gateways' too), and what this gateway sent it since
    reported_in_flight: int | None = None
    num_sent_since_report: int = 0
    # the model names it serves (its /v1/models at the last health check); None: not known
    # (no such route, or it needs a key the gateway lacks), so it is tried for any model
    models: frozenset[str] | None = None
    # what it answered (HTTP status as text) and why requests left it for another replica
    num_responses: Counter[str] = field(default_factory=Counter)
    num_retries: Counter[str] = field(default_factory=Counter)
    num_transitions: Counter[str] = field(default_factory=Counter)  # to "up" / "down"
    # a request's time through the gateway to its response's end, answered by this backend
    duration: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS["e2e"]))
    last_error: str = ""  # why it was last marked down

    @property
    def is_available(self) -> bool:
        return self.is_healthy and not self.is_draining

    @property
    def load(self) -> int:
        """Requests open on the replica as best known: this gateway's own, or its last report
        plus what was sent since, whichever is more (a report counts requests that ended
        since, so it can only overstate; other gateways' requests only a report shows)."""
        if self.reported_in_flight is None:
            return self.num_in_flight
        return max(self.num_in_flight, self.reported_in_flight + self.num_sent_since_report)

    def start_request(self) -> None:
        self.num_in_flight += 1
        self.num_sent_since_report += 1

    def end_request(self) -> None:
        self.num_in_flight -= 1
        assert self.num_in_flight >= 0

    def report_in_flight(self, num: int | None) -> None:
        self.reported_in_flight = num
        self.num_sent_since_report = 0

    def may_serve(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def set_healthy(self, is_healthy: bool, error: str = "") -> bool:
        """Records a health reading; True when it changed the backend's state."""
        if not is_healthy:
            self.last_error = error
        if is_healthy == self.is_healthy:
            return False
        self.is_healthy = is_healthy
        self.num_transitions["up" if is_healthy else "down"] += 1
        return True


class RoundRobin:
    """Each available backend in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Backend], key: str | None) -> Backend:
        self._turn += 1
        return candidates[self._turn % len(candidates)]


class LeastLoaded:
    """The backend with the fewest requests open (`Backend.load`: this gateway's, or the
    replica's own count where it reports one); ties taken in turn, so an idle pool is spread
    evenly rather than always starting at the first backend."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Backend], key: str | None) -> Backend:
        self._turn += 1
        n = len(candidates)
        rotated = [candidates[(self._turn + i) % n] for i in range(n)]
        return min(rotated, key=lambda b: b.load)


class SessionAffinity:
    """A session's requests on one backend, so its growing conversation finds its prefix in
    that replica's KV cache: rendezvous hashing of the session key over the backends (adding or
    losing one moves only the sessions that were, or will be, on it), with bounded load (a
    backend takes a session only while it has fewer than `load_factor` x the mean requests in
    flight, else the session's next choice does). Requests without a key go to the least
    loaded."""

    name = "session"

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, got {load_factor}")
        self.load_factor = load_factor
        self._least_loaded = LeastLoaded()

    def choose(self, candidates: Sequence[Backend], key: str | None) -> Backend:
        if key is None:
            return self._least_loaded.choose(candidates, key)
        total = sum(b.load for b in candidates) + 1  # this request included
        cap = math.ceil(self.load_factor * total / len(candidates))
        ranked = sorted(candidates, key=lambda b: _rendezvous_score(key, b.url), reverse=True)
        # NOTE: some backend is always under the cap: they cannot all hold more than the mean
        return next(b for b in ranked if b.load < cap)


def _rendezvous_score(key: str, url: str) -> int:
    """A stable hash of (key, backend): the same in every process, unlike hash()."""
    digest = hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


POLICIES = {p.name: p for p in (RoundRobin, LeastLoaded, SessionAffinity)}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()


def backends_to_try(
    policy, backends: Sequence[Backend], max_attempts: int, key: str | None = None,
    model: str | None = None,
) -> Iterator[Backend]:  # fmt: skip
    """The replicas one request tries in turn, at most max_attempts: each the policy's pick
    among those it has not tried, made once the one before failed (so what the health checks
    learnt meanwhile counts)."""
    tried: set[str] = set()
    for _ in range(max_attempts):
        backend = choose_backend(policy, backends, key, tried, model)
        if backend is None:
            return
        tried.add(backend.url)
        yield backend


def choose_backend(
    policy, backends: Sequence[Backend], key: str | None, tried: set[str], model: str | None = None
) -> Backend | None:
    """The policy's pick among the available backends that may serve `model` and that this
    request has not tried yet."""
    candidates = [
        b for b in backends if b.is_available and b.url not in tried and b.may_serve(model)
    ]
    return policy.choose(candidates, key) if candidates else None
