"""Scheduler on CPU with a fake runner: budgets, chunked prefill, preemption, priority, abort."""

from __future__ import annotations

import subprocess
import sys

from lantau.config import SchedulerConfig
from lantau.kv_cache.manager import KVCacheManager
from lantau.request import FinishReason, Request, RequestStatus, SamplingParams
from lantau.scheduler.output import RunnerOutput, SchedulerOutput
from lantau.scheduler.scheduler import Scheduler

BS = 4


class FakeRunner:
    """Tracks tokens like the model runner; the next token is a function of the history."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for r in out.scheduled_new_reqs:
            self.tokens[r.request_id] = list(r.token_ids)
        result = RunnerOutput()
        for r in [*out.scheduled_new_reqs, *out.scheduled_cached_reqs]:
            end = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
            tokens = self.tokens[r.request_id]
            if end == len(tokens):
                token = sum(tokens) % 50 + 3
                tokens.append(token)
                result.sampled_token_ids[r.request_id] = token
        return result


def make_scheduler(num_blocks=64, **kwargs) -> Scheduler:
    config = SchedulerConfig(max_model_len=256, **kwargs)
    return Scheduler(config, KVCacheManager(num_blocks, BS))


def add(sched: Scheduler, request_id: str, num_prompt: int, max_tokens=4, priority=0) -> Request:
    req = Request(
        request_id,
        [(i * 7 + len(request_id)) % 40 + 1 for i in range(num_prompt)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
    )
    sched.add_request(req)
    return req


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps=1000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return outs
        out = sched.schedule()
        outs.append(out)
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        sched.update(out, runner.execute(out))
        sched.check_integrity()
    raise AssertionError("did not finish")


def test_no_torch_import():
    """The scheduler and KV manager are plain Python (checked in a fresh interpreter)."""
    code = (
        "import sys, lantau.scheduler.scheduler, lantau.kv_cache.manager; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_chunked_prefill_under_token_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    req = add(sched, "a", 40, max_tokens=3)
    outs = run_to_completion(sched, FakeRunner())
    chunks = [o.num_scheduled_tokens["a"] for o in outs]
    assert chunks == [16, 16, 8, 1, 1]  # 40-token prompt in chunks, then two decodes
    assert req.num_output_tokens == 3 and req.finish_reason == FinishReason.LENGTH
    assert sched.kv_cache.num_free_blocks == 64


def test_decodes_share_steps_with_prefills():
    sched = make_scheduler(max_num_batched_tokens=20)
    add(sched, "a", 10, max_tokens=5)
    out = sched.schedule()
    runner = FakeRunner()
    sched.update(out, runner.execute(out))
    add(sched, "b", 30, max_tokens=2)
    out = sched.schedule()
    # a decodes (1 token) while b prefills a 19-token chunk in the same step
    assert out.num_scheduled_tokens == {"a": 1, "b": 19}


def test_long_prefill_threshold_caps_each_prompt_not_the_step():
    """A prompt computes at most the threshold's tokens a step, in equal chunks, while the step
    still fills with several prompts' chunks; the tokens are those of an uncapped run."""
    sched = make_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=8)
    reqs = [add(sched, "a", 19, max_tokens=3), add(sched, "bb", 12, max_tokens=3)]
    runner = FakeRunner()
    outs = run_to_completion(sched, runner)
    # 19 in three chunks of 7, 6, 6; 12 in two of 6 (not 8 + 4)
    assert outs[0].num_scheduled_tokens == {"a": 7, "bb": 6}
    assert outs[1].num_scheduled_tokens == {"a": 6, "bb": 6}
    assert outs[2].num_scheduled_tokens == {"a": 6, "bb": 1}
    uncapped = make_scheduler(max_num_batched_tokens=20)
    same = [add(uncapped, "a", 19, max_tokens=3), add(uncapped, "bb", 12, max_tokens=3)]
    run_to_completion(uncapped, FakeRunner())
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in same]
    assert sched.kv_cache.num_free_blocks == 64


def test_a_chunk_takes_its_steps_padding():
    """With the runner's padding known (a step with prompt tokens computes its CUDA graph
    bucket's tokens: multiples of 8 here), a capped prompt's chunk grows into the padding its
    step would compute anyway, never past its prompt; steps with no padding left, and last
    chunks, are as without it; the tokens are those of a run without padding."""
    sched = make_scheduler(max_num_batched_tokens=40, long_prefill_token_threshold=8)
    sched.padded_step_tokens = lambda n: -(-n // 8) * 8 if n <= 32 else n
    decodes = [add(sched, f"d{i}", 4, max_tokens=6) for i in range(3)]
    runner = FakeRunner()
    sched.update(first := sched.schedule(), runner.execute(first))  # the three prefill
    assert first.num_scheduled_tokens == {"d0": 4, "d1": 4, "d2": 4}
    long = add(sched, "long", 19, max_tokens=3)
    out = sched.schedule()
    # 3 decodes + a 7-token chunk (19 in 7 + 6 + 6) = 10 tokens, padded to 16: the chunk takes 13
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 6}  # the rest
    sched.update(out, runner.execute(out))
    run_to_completion(sched, runner)
    plain = make_scheduler(max_num_batched_tokens=40, long_prefill_token_threshold=8)
    same = [add(plain, f"d{i}", 4, max_tokens=6) for i in range(3)]
    plain_runner = FakeRunner()
    plain.update(first := plain.schedule(), plain_runner.execute(first))
    same.append(add(plain, "long", 19, max_tokens=3))
    run_to_completion(plain, plain_runner)
    assert [r.output_token_ids for r in [*decodes, long]] == [r.output_token_ids for r in same]
    assert sched.kv_cache.num_free_blocks == 64


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", 5)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}


def run_overlapped(sched: Scheduler, runner: FakeRunner, max_steps=1000):
    """As EngineCore with async scheduling: step N+1 is scheduled (and run) before step N's
    tokens reach the scheduler."""
    outs, in_flight = [], None
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return outs
        out = sched.schedule()
        outs.append(out)
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        result = runner.execute(out)
        if in_flight is not None:
            sched.update(*in_flight)
        in_flight = (out, result)
        sched.check_integrity()
    raise AssertionError("did not finish")


def test_seats_of_requests_ending_in_flight_go_to_waiting_ones():
    """With overlapped steps, a request whose last token (by length) is in flight is not
    scheduled again, and a waiting request takes its seat in that step: a batch that ends
    together is followed at once by the next prompts, no empty step between (the same tokens
    as one step at a time)."""
    tokens = {}
    for overlapped in (False, True):
        sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
        for i in range(5):
            add(sched, f"r{i}", 5, max_tokens=3)
        outs = (run_overlapped if overlapped else run_to_completion)(sched, runner)
        tokens[overlapped] = runner.tokens
        if overlapped:
            assert all(out.num_scheduled_tokens for out in outs[:-1])  # no empty step
            # r0, r1: prefill, 2 decodes; r2, r3 join as their last token is in flight
            assert [sorted(out.num_scheduled_tokens) for out in outs[:4]] == [
                ["r0", "r1"], ["r0", "r1"], ["r0", "r1"], ["r2", "r3"],
            ]  # fmt: skip
            assert len(sched.running) == 0 and sched.kv_cache.num_free_blocks == 64
    assert tokens[True] == tokens[False]


def test_preemption_takes_lowest_priority_then_newest_and_recomputes():
    # 6 blocks of 4 tokens; three requests of 6 prompt + 6 output tokens need 9 blocks at the end
    sched = make_scheduler(num_blocks=6)
    reqs = [add(sched, f"r{i}", 6, max_tokens=6) for i in range(3)]
    reqs[0].priority = 1  # lower priority than the others (larger value runs later)
    runner = FakeRunner()
    preempted: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        preempted.extend(sorted(out.preempted_req_ids))
        sched.update(out, runner.execute(out))
        sched.check_integrity()
    assert preempted and preempted[0] == "r0"
    assert all(r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert reqs[0].num_preemptions >= 1
    assert sched.kv_cache.num_free_blocks == 6


def test_same_tokens_with_and_without_preemption():
    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
        reqs = [add(sched, f"q{i}", 5 + 3 * i, max_tokens=8) for i in range(6)]
        run_to_completion(sched, FakeRunner())
        return [r.output_token_ids for r in reqs], sum(r.num_preemptions for r in reqs)

    big, n_big = run(200)
    small, n_small = run(12)
    assert n_big == 0 and n_small > 0
    assert big == small


def test_priority_orders_admission():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, "low", 4, priority=5)
    add(sched, "high", 4, priority=-1)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["high"]


def test_abort_anywhere_frees_blocks():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner()
    running = add(sched, "run", 20)
    waiting = add(sched, "wait", 20)
    out = sched.schedule()  # "run" gets a chunk, "wait" waits
    sched.update(out, runner.execute(out))
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    sched.finish_requests(["run", "wait", "unknown"], FinishReason.ABORT)
    assert running.finish_reason == FinishReason.ABORT
    assert not sched.has_unfinished and sched.kv_cache.num_free_blocks == 64
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.is_empty
    sched.check_integrity()


def test_prefix_hits_count_as_computed():
    sched = make_scheduler()
    runner = FakeRunner()
    a = add(sched, "a", 13, max_tokens=1)
    run_to_completion(sched, runner)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=1))
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 12 and out.num_scheduled_tokens["b"] == 1
