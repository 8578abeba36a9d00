"""The engine end to end on a tiny random model: continuous batching, preemption, chunked
prefill and prefix caching all give the tokens a lone request gets; seeds, n, stop tokens."""

from __future__ import annotations

import random

import pytest

from lantau import LLM, SamplingParams
from lantau.errors import InvalidRequestError


def random_prompts(num: int, seed: int = 0, max_len: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def check_clean(llm: LLM) -> None:
    """No request or block left behind."""
    core = llm.engine.core
    core.scheduler.check_integrity()
    assert not core.scheduler.requests
    assert core.kv_cache.num_free_blocks == core.config.cache.num_blocks


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Each of 32 mixed-length requests run alone (greedy and seeded)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=512)
    rng = random.Random(1)
    prompts = random_prompts(32)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else 100 + i,
            max_tokens=rng.randint(1, 48),
            ignore_eos=True,
        )
        for i in range(32)
    ]
    alone = [
        llm.generate([{"prompt_token_ids": p}], sp)[0]
        for p, sp in zip(prompts, params, strict=True)
    ]
    return prompts, params, [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512),
        dict(num_kv_blocks=512, max_num_batched_tokens=16),  # chunked prefill of 16 tokens
        dict(num_kv_blocks=17, max_model_len=256),  # 272 slots for ~3,000 tokens: preemption
        dict(num_kv_blocks=17, max_model_len=256, max_num_batched_tokens=16),
    ],
    ids=["batched", "chunked16", "preempt", "preempt+chunked16"],
)
def test_continuous_batching_matches_one_at_a_time(tiny_llama_dir, reference, engine_args):
    prompts, params, expected = reference
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if engine_args["num_kv_blocks"] == 17:
        assert llm.engine.core.scheduler.num_preemptions > 0
    check_clean(llm)


@pytest.mark.parametrize("chunk", [None, 16])
def test_guaranteed_no_evict_never_preempts(tiny_llama_dir, reference, chunk):
    """The cache that makes max_utilization preempt (test above): admission waits for room
    for every request's whole output instead, and the tokens are the lone-request ones."""
    prompts, params, expected = reference
    extra = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=17, max_model_len=256,
        scheduling_policy="guaranteed_no_evict", **extra,
    )  # fmt: skip
    peak = []
    step = llm.engine.core.scheduler.schedule

    def schedule():
        out = step()
        peak.append(llm.engine.core.scheduler.num_running)
        return out

    llm.engine.core.scheduler.schedule = schedule
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.core.scheduler.num_preemptions == 0
    assert max(peak) > 1  # it still batched
    check_clean(llm)
    with pytest.raises(ValueError, match="policy"):
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=17, scheduling_policy="lifo")


def test_prefix_caching_computes_only_the_rest(tiny_llama_dir):
    block = 16
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    plain = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
        enable_prefix_caching=False,
    )  # fmt: skip
    prefix = list(range(10, 10 + 3 * block))
    first = {"prompt_token_ids": prefix + [7, 8, 9, 10, 11]}
    second = {"prompt_token_ids": prefix + [300, 301, 302]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out1 = llm.generate(first, params)[0]
    out2 = llm.generate(second, params)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 3 * block  # the 3 shared blocks were not recomputed
    assert out2.outputs[0].token_ids == plain.generate(second, params)[0].outputs[0].token_ids
    check_clean(llm)
    assert llm.reset_prefix_cache() > 0  # every block is free, so every hash goes
    out3 = llm.generate(second, params)[0]
    assert out3.num_cached_tokens == 0 and out3.outputs[0].token_ids == out2.outputs[0].token_ids
    check_clean(llm)


def test_seeded_sampling_reproducible_across_runs_and_batch_positions(tiny_llama_dir):
    prompts = random_prompts(6, seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    target = {"prompt_token_ids": prompts[0]}
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    alone = llm.generate(target, seeded)[0].outputs[0].token_ids
    batch = [{"prompt_token_ids": p} for p in prompts[1:4]] + [target]
    at_end = llm.generate(batch, [other] * 3 + [seeded])[3].outputs[0].token_ids
    llm2 = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    again = llm2.generate(target, seeded)[0].outputs[0].token_ids
    assert alone == at_end == again


def test_n_samples(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    prompt = {"prompt_token_ids": random_prompts(1, seed=9)[0]}
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    single = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    assert out.outputs[0].token_ids == llm.generate(prompt, single)[0].outputs[0].token_ids
    check_clean(llm)


def test_stop_token_ids_eos_and_max_tokens(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    prompt = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    stop_at = next(i for i in range(3, 20) if tokens[i] not in tokens[:i])
    stopped = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[stop_at]])
    )[0].outputs[0]
    assert stopped.token_ids == tokens[: stop_at + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == tokens[stop_at]
    short = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert short[0].outputs[0].token_ids == tokens[:2]
    assert short[0].outputs[0].finish_reason == "length"
    check_clean(llm)


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(tiny_llama_dir, tmp_path):
    """min_tokens (vLLM's): EOS and stop tokens are banned from the first min_tokens outputs
    (the greedy pick moves to the next best), stop strings are not looked for in them; past
    them each ends the sequence as before. A model whose EOS is the greedy's first token."""
    import transformers

    from tests.conftest import TINY_LLAMA, save_tiny_hf_model

    prompt = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    plain = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    eos = tokens[0]
    save_tiny_hf_model(tmp_path, transformers.LlamaConfig(**{**TINY_LLAMA, "eos_token_id": eos}))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64)
    ended = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert ended.token_ids == [eos] and ended.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=4))
    out = held[0].outputs[0].token_ids
    assert len(out) >= 5 and eos not in out[:4] and (len(out) == 12 or out[-1] == eos)
    # the same, stop tokens and sampled rows too, on the plain model
    stop_token = tokens[1]
    for params in (
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=3),
        SamplingParams(
            temperature=1.0,
            top_k=1,
            seed=3,
            max_tokens=12,
            min_tokens=3,
            stop_token_ids=[stop_token],
        ),  # fmt: skip
    ):
        out = plain.generate(prompt, params)[0].outputs[0]
        assert len(out.token_ids) >= 4 and stop_token not in out.token_ids[:3]
        assert out.token_ids[0] == tokens[0]  # only the banned token's pick moved
    no_ban = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                   ignore_eos=True))  # fmt: skip
    assert no_ban[0].outputs[0].token_ids == tokens  # nothing to ban: the free greedy tokens
    # stop strings (a model with a tokenizer: random:tiny borrows the default model's)
    worded = LLM("random:tiny", device="cpu", num_kv_blocks=64, max_model_len=512)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    words = worded.generate("Once upon", SamplingParams(**greedy))[0].outputs[0]
    stop = words.text[len(words.text) // 3 :][:2]
    cut = worded.generate("Once upon", SamplingParams(**greedy, stop=[stop]))[0].outputs[0]
    late = worded.generate("Once upon", SamplingParams(**greedy, stop=[stop], min_tokens=12))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 12
    assert late[0].outputs[0].token_ids == words.token_ids
    assert late[0].outputs[0].finish_reason == "length"
    check_clean(worded)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    check_clean(llm)
    check_clean(plain)


def test_max_model_len_ends_with_length(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=40
    )
    out = llm.generate(
        {"prompt_token_ids": list(range(3, 33))}, SamplingParams(max_tokens=100, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    check_clean(llm)


def test_logprobs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token_id].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
    assert out.cumulative_logprob < 0


def _mixed_params(num: int, stop_tokens: dict[int, int] | None = None) -> list[SamplingParams]:
    """Greedy, seeded top-k/top-p, penalties and logprobs, interleaved."""
    rng = random.Random(7)
    params = []
    for i in range(num):
        kind = i % 4
        params.append(
            SamplingParams(
                temperature=0.0 if kind in (0, 2) else 0.8,
                seed=None if kind in (0, 2) else 500 + i,
                top_k=20 if kind == 1 else 0,
                top_p=0.9 if kind == 3 else 1.0,
                repetition_penalty=1.3 if kind == 2 else 1.0,
                frequency_penalty=0.5 if kind == 3 else 0.0,
                logprobs=2 if kind in (0, 3) else None,
                max_tokens=rng.randint(1, 40),
                stop_token_ids=[stop_tokens[i]] if stop_tokens and i in stop_tokens else [],
                ignore_eos=True,
            )
        )
    return params


def _run(tiny_llama_dir, prompts, params, async_scheduling: bool, **engine_args):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", async_scheduling=async_scheduling,
        **engine_args,
    )  # fmt: skip
    runner = llm.engine.core.runner
    pending = []  # rows per step whose input token came from the device
    fill = runner.fill_pending
    runner.fill_pending = lambda ids, inputs: (
        pending.append(len(inputs.pending_rows)),
        fill(ids, inputs),
    )
    outputs = [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    check_clean(llm)
    return llm, outputs, sum(pending)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512),
        dict(num_kv_blocks=17, max_model_len=256, max_num_batched_tokens=16),  # preemption
    ],
    ids=["batched", "preempt+chunked16"],
)
def test_overlapped_steps_match_one_step_at_a_time(tiny_llama_dir, engine_args):
    """Scheduling step N+1 before step N's tokens are back changes no token, logprob or finish
    reason, under penalties, seeds, stop tokens, preemption and chunked prefill."""
    prompts = random_prompts(24, seed=3)
    _, free, _ = _run(tiny_llama_dir, prompts, _mixed_params(24), False, **engine_args)
    stops = {i: o.token_ids[2] for i, o in enumerate(free) if i % 3 == 0 and len(o.token_ids) > 4}
    params = _mixed_params(24, stops)
    sync_llm, sync, sync_pending = _run(tiny_llama_dir, prompts, params, False, **engine_args)
    async_llm, overlapped, async_pending = _run(
        tiny_llama_dir, prompts, params, True, **engine_args
    )
    assert sync_pending == 0 and async_pending > 0  # the overlap really fed device tokens
    assert sum(o.finish_reason == "stop" for o in sync) >= 3
    for a, b in zip(sync, overlapped, strict=True):
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (
            b.token_ids, b.finish_reason, b.stop_reason,
        )  # fmt: skip
        if a.logprobs is not None:  # equal up to fp32 rounding: the batches differ
            for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
                assert {t: lp.rank for t, lp in ea.items()} == {t: lp.rank for t, lp in eb.items()}
                for t, lp in ea.items():
                    assert lp.logprob == pytest.approx(eb[t].logprob, abs=1e-5)
    if engine_args["num_kv_blocks"] == 17:
        assert async_llm.engine.core.scheduler.num_preemptions > 0


def test_overlapped_abort_and_id_reuse_leave_nothing_behind(tiny_llama_dir, reference):
    """Aborting requests with a step in flight, and reusing a finished request's id while its
    last token is still in flight, lose no block and mix no tokens."""
    prompts, params, expected = reference
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    # r0 (greedy) ends on a stop token, so the step after its last is already in flight
    greedy = expected[1]
    stop_at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    stop_params = SamplingParams(
        temperature=0.0, max_tokens=len(greedy), stop_token_ids=[greedy[stop_at]]
    )
    engine.add_request("r0", {"prompt_token_ids": prompts[1]}, stop_params)
    for i in range(3, 8):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
    engine.add_request("r1", {"prompt_token_ids": prompts[9]}, params[9])
    engine.add_request("r2", {"prompt_token_ids": prompts[10]}, params[10])
    finished: dict[str, list[int]] = {}
    reused_in_flight = False
    for step in range(200):
        if step == 3:
            engine.abort_request("r1")
            engine.abort_request("r2")
        for out in engine.step():
            if not out.finished:
                continue
            finished[out.request_id] = out.outputs[0].token_ids
            if out.request_id == "r0" and "first r0" not in finished:
                finished["first r0"] = out.outputs[0].token_ids
                in_flight = engine.core._in_flight
                reused_in_flight = in_flight is not None and "r0#0" in in_flight[1].sample_ids
                engine.add_request("r0", {"prompt_token_ids": prompts[8]}, params[8])
        if not engine.has_unfinished_requests:
            break
    assert reused_in_flight
    assert finished["first r0"] == greedy[: stop_at + 1]
    assert finished["r0"] == expected[8]
    assert "r1" not in finished and "r2" not in finished
    for i in range(3, 8):
        assert finished[f"r{i}"] == expected[i]
    check_clean(llm)


def test_profile_step_packs_the_token_budget_as_separate_prompts(tiny_llama_dir):
    """The start-up memory profile runs a full token budget (100) as max_model_len (32) prompts
    on their own blocks: the packed step's logits for its last, shorter prompt equal that prompt
    run alone."""
    import dataclasses

    import torch

    from lantau.runner.model_runner import ModelRunner, profile_inputs

    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=32,
        max_num_batched_tokens=100,
    )  # fmt: skip
    core = llm.engine.core
    inputs, num_blocks = profile_inputs(core.config)
    assert inputs.seq_lens.tolist() == [32, 32, 32, 4]
    assert len(inputs.input_ids) == 100 and num_blocks == 3 * 2 + 1  # 16-token blocks
    assert len(set(inputs.slot_mapping.tolist())) == 100  # no two tokens share a slot
    alone_config = dataclasses.replace(
        core.config,
        scheduler=dataclasses.replace(core.config.scheduler, max_num_batched_tokens=4),
    )
    alone, alone_blocks = profile_inputs(alone_config)
    assert alone.seq_lens.tolist() == [4] and alone_blocks == 1
    with torch.inference_mode():
        packed = ModelRunner(core.config, core.runner.model, num_blocks, core.device)
        single = ModelRunner(alone_config, core.runner.model, alone_blocks, core.device)
        out, ref = packed._forward_logits(inputs), single._forward_logits(alone)
    assert out.shape == (min(core.config.scheduler.max_num_seqs, 100), ref.shape[1])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)


def test_warm_up_leaves_nothing_behind(tiny_llama_dir, reference):
    """The server's warm-up (run on CUDA before it is ready) ends with no request, block,
    cached prefix or count of its own, and the engine then gives the tokens a fresh one does."""
    from lantau.engine.warmup import PROMPT_LENGTHS, warm_up

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=512,
              max_model_len=512, max_num_batched_tokens=64)  # fmt: skip
    core = llm.engine.core
    assert warm_up(core) > 0
    check_clean(llm)
    assert core.num_generated_tokens == 0 and core.scheduler.num_preemptions == 0
    assert core.scheduler.num_prefix_queried_tokens == 0 and not core.scheduler.newly_scheduled
    assert not core.kv_cache.pool.hash_to_block_id  # the prefix cache is empty again
    assert max(n for n in PROMPT_LENGTHS if n < 512) == 467
    prompts, params, expected = reference
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_offline_engine_warms_up_where_kernels_compile(tiny_llama_dir, reference, monkeypatch):
    """LLM warms up as the served core does where its steps would compile kernels (CUDA),
    before it returns: its start-up stages say so, nothing of it stays, and generate gives
    the reference tokens. On CPU (nothing compiles) it does not."""
    import lantau.llm
    from lantau.engine.warmup import compiles_kernels

    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=512,
                  max_num_batched_tokens=64)  # fmt: skip
    plain = LLM(str(tiny_llama_dir), **kwargs)
    assert not compiles_kernels(plain.engine.core) and "warm_up" not in plain.engine.core.startup_s
    monkeypatch.setattr(lantau.llm, "compiles_kernels", lambda core: True)
    llm = LLM(str(tiny_llama_dir), **kwargs)
    assert llm.engine.core.startup_s["warm_up"] > 0
    check_clean(llm)
    assert llm.engine.core.num_generated_tokens == 0
    assert not llm.engine.core.kv_cache.pool.hash_to_block_id
    prompts, params, expected = reference
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # a short max_model_len: the warm-up's prompts fit it (the sampler's wave too)
    short = LLM(str(tiny_llama_dir), **{**kwargs, "max_model_len": 16})
    assert short.engine.core.startup_s["warm_up"] > 0
    check_clean(short)


def test_steps_of_prefill_chunks_only_compute_no_logits(tiny_llama_dir, monkeypatch):
    """A step whose every request is mid-prompt (a long prompt chunked) needs no logits: the
    lm_head must not run on zero rows (the GEMV path of CUDA steps refused them, crashing the
    engine core on any prompt longer than the token budget)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=16)  # fmt: skip
    model = llm.engine.core.runner.model
    rows, compute_logits = [], model.compute_logits

    def recording(hidden):
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(3, 60))}], params)  # 4 chunks of 16
    assert len(out[0].outputs[0].token_ids) == 3
    assert rows and min(rows) >= 1, rows


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "one-at-a-time"])
def test_on_step_records_every_step(tiny_llama_dir, async_scheduling):
    """EngineCore.on_step (`--step-log`): a record a step, overlapped or not, numbered from 1;
    the prompts' tokens and the decodes across them are exactly the requests'."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, num_kv_blocks=32,
              async_scheduling=async_scheduling, long_prefill_token_threshold=4)  # fmt: skip
    records: list[dict] = []
    llm.engine.core.on_step = records.append
    prompts = [{"prompt_token_ids": [5, 17, 300, 9, 8, 2]}, {"prompt_token_ids": [1, 2, 3]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert sum(r["new"] for r in records) == 2
    assert sum(r["tokens"] - r["decodes"] for r in records) == 9  # 6 in two chunks of 3, and 3
    assert sum(r["decodes"] for r in records) == 2 * 4  # the 5th token: the last step's sample
    assert max(r["tokens"] - r["decodes"] for r in records) <= 3 + 3  # chunks of at most 4
    assert all(r["device_ms"] is None and 0 <= r["host_ms"] <= r["call_ms"] for r in records)
    assert not any(r["behind"] for r in records)  # no copies to find done on the CPU
    if async_scheduling:  # each call takes the step in flight, if it sampled
        assert all(r["collected"] in (None, r["step"] - 1) for r in records)
        assert records[0]["collected"] is None  # nothing in flight yet
    else:
        assert all(r["collected"] == r["step"] for r in records)


def test_a_step_that_samples_nothing_is_collected_by_no_call(tiny_llama_dir):
    """Overlapped steps: a lone prompt cut into chunks of at most 4 samples nothing until its last
    chunk, so no call waits for the first two steps; the records say so (`collected`), which
    lantau.bench.step_log.wall_step_times needs to time steps from the host's clock."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, num_kv_blocks=32,
              long_prefill_token_threshold=4)  # fmt: skip
    records: list[dict] = []
    llm.engine.core.on_step = records.append
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 13))}], params)  # 10 tokens: 3 chunks
    # then two decodes (the prompt's last chunk sampled the first token) and an empty step
    # that collects the last
    assert [r["tokens"] for r in records] == [4, 3, 3, 1, 1, 0]
    assert [r["collected"] for r in records] == [None, None, None, 3, 4, 5]


def test_waiting_prompts_take_the_seats_of_requests_ending_in_flight(tiny_llama_dir):
    """Overlapped steps at max_num_seqs: when every running request's last token (by length)
    is in flight, the next step is the waiting prompts' prefill, not an empty step (the host
    collecting and freeing while the device idles); tokens as one step at a time, nothing
    left behind."""
    prompts = random_prompts(6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    records: list[dict] = []
    outputs = {}
    for overlapped in (False, True):
        llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_num_seqs=2,
                  num_kv_blocks=64, async_scheduling=overlapped)  # fmt: skip
        if overlapped:
            llm.engine.core.on_step = records.append
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[overlapped] = [o.outputs[0].token_ids for o in outs]
        check_clean(llm)
    assert outputs[True] == outputs[False]
    busy = [r["reqs"] for r in records]
    assert 0 not in busy[:-1] and max(busy) == 2, busy  # the last call may only collect
    assert sum(r["new"] for r in records) == 6
