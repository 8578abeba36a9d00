"""`lantau bench serve` and `lantau bench sweep`: a streaming load generator for lantau or any
OpenAI-compatible server (open loop: Poisson arrivals at a rate; closed loop: a cap on requests
in flight), measuring TTFT, TPOT, ITL and end-to-end per request over SSE.

A client only: aiohttp (on the GPU image too), no torch. Statistics live in bench/stats.py,
the report in bench/report.py."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

from lantau.bench.monitor import GpuUtilSampler, MetricsSampler
from lantau.bench.stats import RequestRecord, ServeSummary, Slo, summarize, time_breakdown
from lantau.bench.workloads import make_workload

try:  # NOTE: orjson parses SSE chunks faster; the GPU image has only json
    from orjson import loads as _loads
except ImportError:
    _loads = json.loads


@dataclass(frozen=True)
class ServeRequest:
    prompt: list[int] | str  # token ids (/v1/completions) or text
    max_tokens: int
    num_prompt_tokens: int  # the ids sent, or an estimate for text (4 characters a token)


@dataclass(frozen=True)
class ServeConfig:
    base_url: str  # scheme://host:port
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    model: str | None = None  # the body's model field; None: the server's first /v1/models
    workload: str = "W1"  # W1 | W5 | random:IN/OUT | sharegpt:FILE | any make_workload spec
    num_requests: int | None = None  # None: the workload's own count (W1 500, W5 256), else 100
    rate: float = math.inf  # requests/s of Poisson arrivals; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps between arrivals (1: Poisson)
    concurrency: int | None = None  # most requests in flight (closed loop); None: no cap
    seed: int = 0  # the prompts' random ids and the arrival times
    slo: Slo = field(default_factory=Slo)
    ignore_eos: bool | None = None  # None: on for fixed-length workloads, off for ShareGPT
    api_key: str | None = None
    timeout_s: float = 600.0  # per request
    vocab_size: int = 32000  # random ids are drawn from [256, vocab_size)
    sharegpt_output_len: int | None = None  # None: the recorded reply's length (estimated)
    temperature: float = 0.0
    metrics_interval_s: float = 1.0  # how often /metrics is sampled
    gpu_indices: tuple[int, ...] = (0,)  # NVML devices of this machine to sample
    is_probed: bool = True  # one short request first: a wrong URL or model fails at once
    show_progress: bool = True
    # the server's `--step-log` file (a server on this machine): the run's engine steps
    step_log: str | None = None
    # structured outputs: this JSON schema (response_format json_schema) for this share of
    # the requests, chosen by the seed (vLLM's --structured-output-ratio)
    json_schema: dict | None = None
    structured_output_ratio: float = 1.0
    # LoRA adapters the server serves: each request names one of them, picked at random by the
    # seed (vLLM's --lora-modules); empty: every request names `model`
    lora_modules: tuple[str, ...] = ()
    # an https:// server: the CAs its certificate is checked against (None: the system's), or
    # no check at all (insecure: a test server's own certificate)
    ssl_ca_certs: str | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.structured_output_ratio <= 1.0:
            raise ValueError("--structured-output-ratio must be in [0, 1]")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass(frozen=True)
class ServeResult:
    config: ServeConfig
    summary: ServeSummary
    records: tuple[RequestRecord, ...]
    gpu_util: tuple[tuple[float, float], ...]  # (seconds from the start, % busy)
    server_metrics: dict  # MetricsSampler.summary()
    started_at: str  # ISO 8601, local time
    # what the server says of itself before the run (lantau's /status: its engine's KV
    # cache, tensor-parallel size, start-up); None from a server without one
    server_status: dict | None = None
    # the run's engine steps by kind, from the server's step log (config.step_log)
    engine_steps: dict | None = None
    # with config.lora_modules: each adapter's requests summarized apart
    by_model: dict[str, ServeSummary] = field(default_factory=dict)

    def to_dict(self) -> dict:
        summary = asdict(self.summary)
        summary["num_errors"] = self.summary.num_errors
        out = {
            "kind": "serve",
            "started_at": self.started_at,
            "config": {
                **asdict(self.config),
                "slo": self.config.slo.describe(),
                "api_key": "(set)" if self.config.api_key else None,  # NOTE: never the key
            },
            "summary": summary,
            "gpu_util_mean": _mean([u for _, u in self.gpu_util]),
            "gpu_util": [list(s) for s in self.gpu_util],
            "server_metrics": self.server_metrics,
            "server_status": self.server_status,
            "time_breakdown": time_breakdown(self.summary, self.server_metrics.get("series", {})),
            "engine_steps": self.engine_steps,
            "by_model": {name: asdict(m) for name, m in self.by_model.items()},
            "records": [{**asdict(r), "tpot_s": r.tpot_s} for r in self.records],
        }
        return jsonable(out)


@dataclass(frozen=True)
class SweepResult:
    runs: tuple[ServeResult, ...]  # rising rates; the last one missed the SLO if any did
    max_rate_meeting_slo: float | None

    def to_dict(self) -> dict:
        return jsonable(
            {
                "kind": "sweep",
                "slo": self.runs[0].config.slo.describe() if self.runs else "",
                "rates": [r.config.rate for r in self.runs],
                "max_rate_meeting_slo": self.max_rate_meeting_slo,
                "runs": [r.to_dict() for r in self.runs],
            }
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def jsonable(value):
    """Strict JSON: NaN -> null, infinity -> "inf", tuples -> lists, floats rounded to 1 us."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else round(value, 6)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


# --- the requests --------------------------------------------------------------------------


def make_requests(config: ServeConfig) -> list[ServeRequest]:
    spec = config.workload
    if spec.startswith("sharegpt:"):
        return sharegpt_requests(
            spec.removeprefix("sharegpt:"),
            config.num_requests or 1000,
            config.seed,
            config.sharegpt_output_len,
        )
    m = re.fullmatch(r"random:(\d+)/(\d+)", spec)
    name = f"in:{m[1]}/out:{m[2]}" if m else spec
    num = config.num_requests or (100 if name.startswith("in:") else None)
    workload = make_workload(name, config.vocab_size, num, config.seed)
    return [ServeRequest(p, workload.max_tokens, len(p)) for p in workload.prompts]


def sharegpt_requests(
    path: str, num_requests: int, seed: int, output_len: int | None
) -> list[ServeRequest]:
    """The first human turn of each conversation as the prompt; max_tokens from the reply that
    followed it (4 characters a token) unless output_len is given. Shuffled by the seed."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    random.Random(seed).shuffle(pairs)
    requests = []
    for i in range(num_requests):
        prompt, reply = pairs[i % len(pairs)]
        max_tokens = output_len or min(max(len(reply) // 4, 4), 1024)
        requests.append(ServeRequest(prompt, max_tokens, max(len(prompt) // 4, 1)))
    return requests


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times from the start: all at 0 for an infinite rate, else gaps drawn from a gamma
    distribution of mean 1/rate (shape 1: exponential, a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)  # NOTE: its own stream, so the prompts do not move the times
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return times


def constrained_requests(config: ServeConfig, num_requests: int) -> set[int]:
    """The requests that carry config.json_schema: round(ratio * N) of them, by the seed."""
    if config.json_schema is None:
        return set()
    count = round(config.structured_output_ratio * num_requests)
    return set(random.Random(config.seed).sample(range(num_requests), count))


def request_models(config: ServeConfig, model: str | None, num_requests: int) -> list:
    """Each request's model field: one of config.lora_modules at random (by the seed, a stream
    of its own), else `model`."""
    if not config.lora_modules:
        return [model] * num_requests
    rng = random.Random(f"lora-{config.seed}")
    return [rng.choice(config.lora_modules) for _ in range(num_requests)]


def request_body(
    request: ServeRequest, config: ServeConfig, model: str | None, constrained: bool = False
) -> dict:
    body: dict = {
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if config.is_chat:
        if not isinstance(request.prompt, str):
            raise ValueError(f"{config.workload} sends token ids: use --endpoint /v1/completions")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    ignore_eos = config.ignore_eos
    if ignore_eos is None:
        ignore_eos = not config.workload.startswith("sharegpt:")
    if ignore_eos:
        body["ignore_eos"] = True
    if constrained:
        schema = {"name": "bench", "schema": config.json_schema}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


# --- one request over SSE ------------------------------------------------------------------


class StreamError(Exception):
    """The server reported an error inside the stream, or ended it without [DONE]."""


def _chunk_text(event: dict, is_chat: bool) -> str:
    choices = event.get("choices") or ()
    if not choices:
        return ""
    if is_chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _read_stream(content, is_chat: bool, chunk_times: list[float]) -> dict | None:
    """Reads SSE `data:` lines to [DONE], noting when each chunk with text arrives; returns
    the usage chunk's usage, if any."""
    usage = None
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return usage
        now = time.perf_counter()
        event = _loads(data)
        if "error" in event:
            raise StreamError(str(event["error"]))
        if event.get("usage"):
            usage = event["usage"]
        if _chunk_text(event, is_chat):
            chunk_times.append(now)
    raise StreamError("the stream ended without [DONE]")


async def send_request(
    session, url: str, payload: bytes, headers: dict, request: ServeRequest, index: int,
    origin: float, config: ServeConfig,
) -> RequestRecord:  # fmt: skip
    """One streamed request (its JSON body encoded before the run), timed from its send;
    failures become a record with their kind."""
    import aiohttp

    chunk_times: list[float] = []
    sent = time.perf_counter()
    failed = dict(index=index, start_s=sent - origin, ok=False)
    try:
        timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        async with session.post(url, data=payload, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                await resp.read()
                return RequestRecord(**failed, error=f"http_{resp.status}")
            usage = await _read_stream(resp.content, config.is_chat, chunk_times)
    except TimeoutError:  # NOTE: before ClientError: aiohttp's timeouts are both
        return RequestRecord(**failed, error="timeout")
    except aiohttp.ClientError:
        return RequestRecord(**failed, error="connection")
    except (StreamError, ValueError):
        return RequestRecord(**failed, error="stream")
    end = time.perf_counter()
    first = chunk_times[0] if chunk_times else end
    usage = usage or {}
    return RequestRecord(
        index=index,
        start_s=sent - origin,
        ok=True,
        ttft_s=first - sent,
        e2e_s=end - sent,
        itl_s=tuple(b - a for a, b in itertools.pairwise(chunk_times)),
        num_prompt_tokens=usage.get("prompt_tokens", request.num_prompt_tokens),
        num_output_tokens=usage.get("completion_tokens", len(chunk_times)),
    )


# --- a run ---------------------------------------------------------------------------------


class Progress:
    """A plain progress bar on stderr: redrawn in place on a terminal, else a line every 10 %."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.num_done = self.num_errors = 0
        self.is_tty = sys.stderr.isatty()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = 0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_errors += not record.ok
        if not self.enabled:
            return
        now = time.perf_counter()
        tenth = 10 * self.num_done // self.total
        if self.is_tty and (now - self._last_draw > 0.1 or self.num_done == self.total):
            self._last_draw = now
            sys.stderr.write("\r" + self._line(now))
        elif not self.is_tty and tenth > self._last_tenth:
            self._last_tenth = tenth
            sys.stderr.write(self._line(now) + "\n")

    def _line(self, now: float) -> str:
        filled = 30 * self.num_done // self.total
        bar = "#" * filled + "." * (30 - filled)
        return (
            f"{self.label} [{bar}] {self.num_done}/{self.total} "
            f"errors {self.num_errors} {now - self._start:.1f} s"
        )

    def close(self) -> None:
        if self.enabled and self.is_tty:
            sys.stderr.write("\n")


def _split_url(config: ServeConfig) -> tuple[str, str]:
    """(base, endpoint): a --url with a path names the endpoint itself."""
    parts = urlsplit(config.base_url)
    base = f"{parts.scheme}://{parts.netloc}"
    path = parts.path.rstrip("/")
    return base, (path if path.endswith("completions") else config.endpoint)


async def _served_model(session, base: str, headers: dict) -> str | None:
    try:
        async with session.get(f"{base}/v1/models", headers=headers) as resp:
            if resp.status == 200:
                return (await resp.json())["data"][0]["id"]
    except Exception:  # any failure: send no model field, the server picks its own
        pass
    return None


STATUS_FIELDS = ("model", "num_kv_blocks", "kv_cache_dtype", "tensor_parallel_size", "startup_s")


async def _server_status(session, base: str, headers: dict) -> dict | None:
    """lantau's /status fields that describe the deployment (STATUS_FIELDS), or None."""
    try:
        async with session.get(f"{base}/status", headers=headers) as resp:
            if resp.status == 200:
                status = await resp.json()
                return {k: status[k] for k in STATUS_FIELDS if k in status} or None
    except Exception:  # another server, or none there: the report goes without it
        pass
    return None


async def _probe(session, url: str, body: dict, headers: dict) -> None:
    """One short request (the first prompt's start, 2 tokens): a wrong URL, model or vocab
    fails here with the server's message rather than as N errors."""
    prompt = body.get("prompt")
    probe = {**body, "max_tokens": 2}
    if prompt is not None:
        probe["prompt"] = prompt[:4] if isinstance(prompt, list) else prompt[:16]
    try:
        async with session.post(url, data=json.dumps(probe), headers=headers) as resp:
            text = await resp.text()
    except Exception as e:
        raise RuntimeError(f"{url}: {type(e).__name__}: {e}") from None
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {text[:500]}")


async def _run_requests(session, url, headers, requests, payloads, config, origin, progress):
    """Each request sent at its arrival time, at most config.concurrency of them in flight."""
    arrivals = arrival_times(len(requests), config.rate, config.burstiness, config.seed)
    gate = asyncio.Semaphore(config.concurrency) if config.concurrency else None

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, origin + arrivals[i] - time.perf_counter()))
        args = (session, url, payloads[i], headers, requests[i], i, origin, config)
        if gate is None:
            record = await send_request(*args)
        else:
            async with gate:
                record = await send_request(*args)
        progress.update(record)
        return record

    return await asyncio.gather(*(one(i) for i in range(len(requests))))


async def run_serve_async(
    config: ServeConfig, requests: list[ServeRequest] | None = None
) -> ServeResult:
    import aiohttp

    requests = requests if requests is not None else make_requests(config)
    base, endpoint = _split_url(config)
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    # no pool cap: the run sets concurrency
    connector = aiohttp.TCPConnector(limit=0, ssl=_tls(config))
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = config.model or await _served_model(session, base, headers)
        status = await _server_status(session, base, headers)
        constrained = constrained_requests(config, len(requests))
        models = request_models(config, model, len(requests))
        bodies = [request_body(r, config, m, i in constrained)
                  for i, (r, m) in enumerate(zip(requests, models, strict=True))]  # fmt: skip
        if config.is_probed and bodies:
            await _probe(session, base + endpoint, bodies[0], headers)
        payloads = [json.dumps(b).encode() for b in bodies]
        metrics = MetricsSampler(f"{base}/metrics", config.metrics_interval_s)
        progress = Progress(len(requests), f"rate {config.rate:g}", config.show_progress)
        started_at = datetime.datetime.now().isoformat(timespec="seconds")
        with GpuUtilSampler(config.gpu_indices, interval_s=0.25) as gpu:
            # the figures before any request: one that ended before a first scrape running
            # beside the requests would fall out of the run's rise
            await metrics.sample(session, time.perf_counter())
            origin, window = time.perf_counter(), time.monotonic()  # the step log's clock
            sampling = asyncio.create_task(metrics.run(session, origin))
            records = await _run_requests(
                session, base + endpoint, headers, requests, payloads, config, origin, progress
            )
            duration = time.perf_counter() - origin
            window_end = time.monotonic()
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            await metrics.sample(session, origin)  # every request ended: the run's last figures
        progress.close()
    by_model: dict[str, list[RequestRecord]] = {}
    if config.lora_modules:  # each adapter's requests apart, over the same run
        for r in records:
            by_model.setdefault(models[r.index], []).append(r)
    return ServeResult(
        config=replace(config, model=model),
        summary=summarize(records, duration, config.slo),
        by_model={
            name: summarize(mine, duration, config.slo) for name, mine in sorted(by_model.items())
        },  # fmt: skip
        records=tuple(records),
        gpu_util=tuple(zip(gpu.times_s, gpu.samples, strict=True)),
        server_metrics=metrics.summary(),
        started_at=started_at,
        server_status=status,
        engine_steps=_engine_steps(config.step_log, window, window_end),
    )


def _engine_steps(path: str | None, start: float, end: float) -> dict | None:
    """The run's steps in the server's step log; None without one (or none written yet)."""
    if not path or not os.path.exists(path):
        return None
    from lantau.bench.step_log import read_step_log, summarize_steps

    return summarize_steps(read_step_log(path), start, end)


def doubling_rates(start: float, stop: float) -> list[float]:
    rates, rate = [], start
    while rate <= stop:
        rates.append(rate)
        rate *= 2
    return rates


async def run_sweep_async(config: ServeConfig, rates: list[float], log=print) -> SweepResult:
    """One run per rate, rising, until the first that misses the SLO (kept: it bounds the
    curve). Each run draws new prompts (seed + its place), so no run hits the prefixes a
    previous one left in the server's cache."""
    runs: list[ServeResult] = []
    for i, rate in enumerate(sorted(rates)):
        result = await run_serve_async(replace(config, rate=rate, seed=config.seed + i))
        runs.append(result)
        s = result.summary
        log(
            f"rate {rate:g}: {s.request_throughput:.2f} req/s, {s.output_throughput:.0f} tok/s, "
            f"TTFT P95 {s.ttft.p95:.1f} ms, TPOT P95 {s.tpot.p95:.2f} ms, "
            f"errors {s.num_errors}: SLO {'met' if s.meets_slo else 'missed'}"
        )
        if not s.meets_slo:
            break
    met = [r.config.rate for r in runs if r.summary.meets_slo]
    return SweepResult(tuple(runs), max(met) if met else None)


def _event_loop_runner():
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def run_serve(config: ServeConfig, requests: list[ServeRequest] | None = None) -> ServeResult:
    return _event_loop_runner()(run_serve_async(config, requests))


def run_sweep(config: ServeConfig, rates: list[float], log=print) -> SweepResult:
    return _event_loop_runner()(run_sweep_async(config, rates, log))


def config_from_args(args) -> ServeConfig:
    """The CLI's flags (lantau/cli.py, `bench serve` and `bench sweep`) as a ServeConfig."""
    return ServeConfig(
        base_url=args.url,
        endpoint=args.endpoint,
        model=args.model,
        workload=args.workload,
        num_requests=args.num_requests,
        rate=getattr(args, "rate", math.inf),
        burstiness=args.burstiness,
        concurrency=args.concurrency,
        seed=args.seed,
        slo=Slo.parse(args.slo),
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
        vocab_size=args.vocab_size,
        sharegpt_output_len=args.sharegpt_output_len,
        temperature=args.temperature,
        metrics_interval_s=args.metrics_interval,
        gpu_indices=tuple(int(i) for i in args.gpu_index.split(",") if i),
        is_probed=args.probe,
        show_progress=args.progress,
        step_log=args.step_log,
        json_schema=_json_schema(args.json_schema),
        structured_output_ratio=args.structured_output_ratio,
        lora_modules=tuple(args.lora_modules or ()),
        ssl_ca_certs=args.ssl_ca_certs,
        insecure=args.insecure,
    )


def _tls(config: ServeConfig):
    """aiohttp's `ssl` for an https:// server: the default checks, a CA file's, or none."""
    if config.insecure:
        return False
    if config.ssl_ca_certs is None:
        return True
    import ssl

    return ssl.create_default_context(cafile=config.ssl_ca_certs)


def _json_schema(path: str | None) -> dict | None:
    """`--json-schema FILE`'s schema (None without one); ValueError naming a bad file."""
    if path is None:
        return None
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object")
    return schema


def parse_rates(text: str) -> list[float]:
    """Rates from text: "2,4,8,inf" -> [2.0, 4.0, 8.0, inf]."""
    return [float(r) for r in text.split(",") if r.strip()]
