"""Tensor parallelism on CPU with gloo: a model split over 2 ranks (real processes, one
process group) computes the logits the whole model computes — a prefill and a decode step
through the paged KV cache — for HF folders (tied and untied embeddings, q/k/v biases) against
HF transformers itself, and for random weights against the same shape on one rank. Sizes that
do not split are refused, naming the field."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from lantau.model.forward_context import AttentionMetadata, ForwardContext
from lantau.model.loader import build_model, read_model_config, resolve_model_source
from lantau.model.parallel import SINGLE, TensorParallel, init_tensor_parallel
from tests.conftest import TINY_LLAMA, save_tiny_hf_model

BLOCK_SIZE, NUM_BLOCKS = 16, 8
PROMPT = [5, 17, 300, 42, 9, 77, 128, 3, 64, 250, 11, 400, 8, 99, 23, 310, 45, 6, 71, 200, 13]
COMMON = {k: v for k, v in TINY_LLAMA.items() if not k.endswith("_token_id")}


def _context(positions: list[int], kv_caches, query_len: int) -> ForwardContext:
    seq_len = positions[-1] + 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(NUM_BLOCKS, dtype=torch.int32)[None],
        max_query_len=query_len,
        max_seq_len=seq_len,
    )
    return ForwardContext(meta, kv_caches, torch.tensor(positions, dtype=torch.int64))


def split_logits(model_name: str, tp: TensorParallel, dtype=torch.float32) -> torch.Tensor:
    """The prompt's prefill logits, then one decode step's (the greedy next token), stacked:
    [len(PROMPT) + 1, vocab]. Each rank's KV cache holds its own heads."""
    source = resolve_model_source(model_name)
    config = read_model_config(source)
    model = build_model(source, config, dtype, torch.device("cpu"), seed=7, tp=tp)
    attn = model.model.layers[0].self_attn
    kv_caches = [
        torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        for _ in range(config.num_hidden_layers)
    ]
    n = len(PROMPT)
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), _context(list(range(n)), kv_caches, n))
        prefill = model.compute_logits(hidden)
        next_id = prefill[-1].argmax().view(1)
        decode = model.decode_logits(next_id, _context([n], kv_caches, 1))
    return torch.cat([prefill, decode]).float()


def _rank(rank: int, size: int, address: str, model_name: str, out: str) -> None:
    tp = init_tensor_parallel(rank, size, address, torch.device("cpu"))
    try:
        logits = split_logits(model_name, tp)
        torch.save(logits, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def run_split(model_name: str, size: int, tmp_path) -> list[torch.Tensor]:
    """Each rank's logits, computed in `size` spawned processes (one gloo group)."""
    out = tmp_path / "logits"
    address = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank, (size, address, model_name, str(out)), size, start_method="spawn")
    return [torch.load(f"{out}.{r}") for r in range(size)]


@pytest.mark.parametrize("variant", ["untied", "tied-bias"])
def test_split_over_two_ranks_matches_hf(tmp_path, variant):
    if variant == "untied":
        hf_config = transformers.LlamaConfig(**COMMON)
    else:  # Qwen2: q/k/v biases, tied embeddings (a split lm_head copies its rows)
        hf_config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    folder = tmp_path / "hf"
    hf_model = save_tiny_hf_model(folder, hf_config)
    if variant != "untied":
        with torch.no_grad():  # nonzero biases, or their split would go unchecked
            for layer in hf_model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
        hf_model.save_pretrained(folder)
    ranks = run_split(str(folder), 2, tmp_path)
    whole = split_logits(str(folder), SINGLE)
    with torch.no_grad():
        prompt = torch.tensor([PROMPT])
        hf_prefill = hf_model(prompt).logits[0]
        next_id = hf_prefill[-1].argmax().view(1, 1)
        hf_decode = hf_model(torch.cat([prompt, next_id], dim=1)).logits[0, -1:]
    reference = torch.cat([hf_prefill, hf_decode])
    for logits in ranks:  # every rank has the whole vocabulary's logits
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() <= 1e-4
    assert torch.equal(ranks[0], ranks[1])
    assert (whole - reference).abs().max().item() <= 1e-4


def test_random_weights_split_are_the_whole_models(tmp_path):
    """random:tiny (tied embeddings) drawn whole and sliced: the same model on 2 ranks."""
    ranks = run_split("random:tiny", 2, tmp_path)
    whole = split_logits("random:tiny", SINGLE)
    assert (ranks[0] - whole).abs().max().item() <= 1e-5
    assert torch.equal(ranks[0], ranks[1])


def test_sizes_that_do_not_split_are_refused():
    source = resolve_model_source("random:tiny")
    config = read_model_config(source)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide num_key_value_heads"):
        build_model(source, config, torch.float32, torch.device("cpu"), 0,
                    tp=TensorParallel(0, 4))  # fmt: skip
    odd = dataclasses.replace(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(ValueError, match="does not divide vocab_size"):
        build_model(source, odd, torch.float32, torch.device("cpu"), 0,
                    tp=TensorParallel(0, 2))  # fmt: skip


def test_shard_slices_fused_and_hf_tensors():
    """The layout's own rules, on labelled rows: rank 1 of 2 takes the second half of each
    stacked part of a fused qkv (q, then k, then v), the second half of o_proj's columns."""
    config = read_model_config(resolve_model_source("random:tiny"))  # q 64 rows, kv 32 each
    tp = TensorParallel(1, 2)
    rows = torch.arange(config.q_size + 2 * config.kv_size)[:, None].expand(-1, 3)
    qkv = tp.shard("model.layers.0.self_attn.qkv_proj.weight", rows, config)[:, 0].tolist()
    assert qkv == [*range(32, 64), *range(80, 96), *range(112, 128)]
    k = tp.shard("model.layers.0.self_attn.k_proj.weight", torch.arange(32), config)
    assert k.tolist() == list(range(16, 32))
    cols = torch.arange(config.q_size)[None].expand(5, -1)
    o = tp.shard("model.layers.0.self_attn.o_proj.weight", cols, config)
    assert o[0].tolist() == list(range(32, 64)) and o.shape == (5, 32)
    norm = torch.ones(config.hidden_size)
    assert tp.shard("model.layers.0.input_layernorm.weight", norm, config) is norm
    assert tp.whole_shape("model.layers.0.mlp.down_proj.weight", torch.Size([64, 64])) == (
        64,
        128,
    )


def test_engine_split_over_two_ranks(tiny_llama_dir):
    """`LLM(..., tensor_parallel_size=2)`: rank 1 a worker process in lockstep with the engine
    core's runner. Greedy tokens and logits equal HF transformers' (prompts of several lengths
    in one batch, chunked and overlapped steps); seeded and unseeded sampling equal the
    one-rank engine's; no KV block is left; the worker stops with the engine."""
    import gc

    from lantau import LLM, SamplingParams
    from tests.conftest import hf_greedy
    from tests.test_parity_hf import NUM_TOKENS, make_prompts

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    hf_model.generation_config.eos_token_id = None
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    common = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_num_batched_tokens=64)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **common)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    for i, output in enumerate(outputs):
        hf_tokens, hf_logits = hf_greedy(hf_model, prompts[i]["prompt_token_ids"], NUM_TOKENS)
        assert output.outputs[0].token_ids == hf_tokens, f"prompt {i}"
        if i % 3 == 0:  # alone, so the last step is this request's
            (alone,) = llm.generate([prompts[i]], greedy)
            ours = llm.engine.core.runner.last_logits[f"{alone.request_id}#0"].float()
            assert (ours - hf_logits).abs().max().item() <= 1e-4, f"prompt {i}"
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True),
               SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)]  # fmt: skip
    split = [[o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in sampled]
    # the prompt's logprobs (every rank computes the logits, gathered) and a logit bias
    extras = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2,
        logit_bias={7: 5.0, 9: -100.0},
    )  # fmt: skip
    split_extras = llm.generate(prompts, extras)
    llm.engine.core.scheduler.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == 256
    workers = list(llm.engine.core.workers.processes)
    assert len(workers) == 1 and workers[0].is_alive()
    del llm
    gc.collect()
    workers[0].join(10)
    assert not workers[0].is_alive()
    one = LLM(str(tiny_llama_dir), **common)
    whole = [[o.outputs[0].token_ids for o in one.generate(prompts, p)] for p in sampled]
    assert split == whole
    for a, b in zip(split_extras, one.generate(prompts, extras), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) and a.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_engine_refuses_a_split_that_does_not_divide(tiny_llama_dir):
    from lantau import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide num_attention"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, device="cpu")


def test_served_split_model_and_a_killed_server_leaves_no_process():
    """`lantau serve random:tiny -tp 2` (CPU, gloo): a greedy completion equals the one-rank
    engine's; SIGKILL of the server takes its engine core and the core's rank-1 worker with
    it (each one's watchdog), while a stream is in flight."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from lantau import LLM, SamplingParams
    from tests.test_hardening import STREAM_FOREVER, Server, wait_gone

    body = {"prompt": "Count with me:", "max_tokens": 16, "temperature": 0.0}
    server = Server("-tp", "2")
    try:
        assert server.status()["tensor_parallel_size"] == 2
        tree = server.tree()
        assert len(tree) >= 4, tree  # the server, its core, the core's worker (+ a tracker)
        served = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
        stream = subprocess.Popen([sys.executable, "-c", STREAM_FOREVER, server.base])
        time.sleep(1.0)
        os.kill(server.proc.pid, signal.SIGKILL)
        assert not wait_gone(tree, timeout=5.0), "processes of the server's tree still alive"
        stream.wait(timeout=30)
    finally:
        server.close()
    one = LLM("random:tiny", device="cpu", max_model_len=512, num_kv_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    (expected,) = one.generate(["Count with me:"], params)
    assert served["choices"][0]["text"] == expected.outputs[0].text


def test_engine_folder_built_for_two_ranks(tmp_path, tiny_llama_dir):
    """`lantau build --tensor-parallel-size 2`: each rank's slice in its own shards (a rank
    reads only its bytes); the folder serves on 2 ranks by itself and equals HF's greedy
    tokens; another size is refused either way, saying what to do."""
    from lantau import LLM, SamplingParams
    from lantau.model.build import build_engine
    from lantau.model.manifest import read_manifest
    from tests.conftest import hf_greedy

    folder = tmp_path / "engine"
    manifest = build_engine(str(tiny_llama_dir), folder, dtype="fp32", device="cpu",
                            tensor_parallel_size=2)  # fmt: skip
    assert manifest.tensor_parallel_size == 2
    assert {s.split("-")[0] for s in manifest.shards} == {"rank0", "rank1"}
    assert set(manifest.shards_of(1)) == {s for s in manifest.shards if s.startswith("rank1-")}
    assert read_manifest(folder).fingerprint == manifest.fingerprint
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    assert llm.config.tensor_parallel_size == 2
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    hf_model.generation_config.eos_token_id = None
    prompt = PROMPT[:9]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy)
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)[0]
    del llm
    with pytest.raises(ValueError, match="built for 2 rank.*--tensor-parallel-size 2"):
        LLM(str(folder), device="cpu", tensor_parallel_size=1)
    one = tmp_path / "one"
    build_engine(str(tiny_llama_dir), one, dtype="fp32", device="cpu")
    with pytest.raises(
        ValueError, match="rebuild it with `lantau build .* --tensor-parallel-size 2`"
    ):
        LLM(str(one), device="cpu", tensor_parallel_size=2)


def test_a_split_engine_that_fails_to_start_leaves_nothing(tiny_llama_dir):
    """A start that fails after the workers joined (a KV cache too small for one request):
    the error is the engine's own, the worker stops, and the next split engine in this
    process starts (the group was destroyed with the failed one)."""
    import psutil

    from lantau import LLM

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="the KV cache holds 2 blocks"):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, num_kv_blocks=2,
            max_model_len=256)  # fmt: skip
    left = [p for p in psutil.Process().children() if p.pid not in before]
    assert not [p for p in left if "spawn_main" in " ".join(p.cmdline())]
    llm = LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT[:5]}])
    assert len(out.outputs[0].token_ids) > 0


def test_a_dead_worker_fails_the_served_engine_not_its_requests_forever():
    """SIGKILL of the rank-1 worker mid-stream: the engine core exits at once (a rank waits
    in its next collective otherwise), the stream ends with an error instead of hanging, and
    the server stops, leaving no process."""
    import os
    import signal

    import httpx
    import psutil

    from tests.test_hardening import Server, wait_gone

    server = Server("-tp", "2")
    try:
        tree = server.tree()
        core = psutil.Process(server.status()["engine_pid"])
        (worker,) = [p for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]
        body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if len(lines) == 4:
                    os.kill(worker.pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]" and any('"error"' in ln for ln in lines), lines[-3:]
        assert sum('"text"' in ln for ln in lines) < 400
        assert server.proc.wait(timeout=30) == 1
        assert not wait_gone(tree, timeout=5.0)
    finally:
        server.close()


def test_a_worker_dying_while_idle_stops_the_served_engine():
    """No collective in flight to fail (NCCL would not fail one for minutes): the core's
    watch on its workers ends the engine, and the server exits non-zero, saying why."""
    import os
    import signal

    import psutil

    from tests.test_hardening import Server

    server = Server("-tp", "2")
    try:
        core = psutil.Process(server.status()["engine_pid"])
        (worker,) = [p for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]
        os.kill(worker.pid, signal.SIGKILL)
        assert server.proc.wait(timeout=15) == 1
    finally:
        log = server.close()
    assert "tensor-parallel worker lantau-tp-rank1 exited (code -9)" in log


def test_fp8_random_weights_split():
    """random:tiny in fp8 on each of 2 ranks (no group needed to build): the column-split
    layers' e4m3 rows and scales are exactly the whole model's rows; the row-split layers'
    (o_proj, down_proj: scales over the rank's columns) dequantize to the whole model's
    columns within one e4m3 step (two roundings of the same values, 2^-3 apart at most)."""
    from lantau.model.fp8 import dequantize_rows
    from lantau.model.parallel import split_axis

    source = resolve_model_source("random:tiny")
    config = dataclasses.replace(read_model_config(source), quantization="fp8")

    def params(tp: TensorParallel) -> dict[str, torch.Tensor]:
        model = build_model(source, config, torch.bfloat16, torch.device("cpu"), 3, tp=tp)
        return dict(model.named_parameters())

    whole = params(SINGLE)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        ours = params(tp)
        for name, param in ours.items():
            tied = name == "lm_head.weight" and name not in whole  # the embedding's rows
            expected = tp.shard(name, whole["model.embed_tokens.weight" if tied else name], config)
            if param.dtype != torch.float8_e4m3fn:  # embedding, norms, lm_head; scales
                if not (name.endswith("_scale") and split_axis(name) is None):
                    assert torch.equal(param, expected), name
                continue
            if split_axis(name) == 0:  # the same rows, the same bytes
                assert torch.equal(param.view(torch.uint8), expected.view(torch.uint8)), name
            scale = name + "_scale"
            mine = dequantize_rows(param, ours[scale])
            theirs = tp.shard(name, dequantize_rows(whole[name], whole[scale]), config)
            assert torch.allclose(mine, theirs, rtol=0.13, atol=1e-3), name  # an e4m3 step


def test_a_step_reaches_the_workers_whole():
    """What the workers decode is the step rank 0 scheduled, every sampling field included
    (a field msgpack cannot carry would fail here, not as ranks drifting apart)."""
    import msgspec

    from lantau.engine.tp_workers import Launch, WorkerMessage
    from lantau.request import SamplingParams
    from lantau.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    params = SamplingParams(
        n=2, max_tokens=7, temperature=0.5, top_k=5, top_p=0.8, min_p=0.1,
        repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4, seed=9,
        stop=("x", "yz"), stop_token_ids=(3, 4), ignore_eos=True,
        include_stop_str_in_output=True, logprobs=3, skip_special_tokens=False,
        detokenize=False, logit_bias={5: -100.0, 7: 2.5}, prompt_logprobs=2, min_tokens=2,
        structured_outputs={"regex": "a+"}, cache_salt="tenant-1", grammar_after=(6, 8),
        lora="brand-a",
    )  # fmt: skip
    assert all(getattr(params, f) != getattr(SamplingParams(), f)
               for f in SamplingParams.__dataclass_fields__)  # fmt: skip
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a#0", [1, 2, 3], 2, params, [4, 5], 1, (2, 9))],
        scheduled_cached_reqs=[CachedRequestData("b#1", [9], 40)],
        num_scheduled_tokens={"a#0": 2, "b#1": 1},
        finished_req_ids={"c#0"},
        preempted_req_ids={"d#0"},
    )
    data = msgspec.msgpack.Encoder().encode(Launch(out))
    assert msgspec.msgpack.Decoder(WorkerMessage).decode(data) == Launch(out)


def test_more_ranks_than_gpus_is_refused():
    from lantau.engine.args import build_engine_config
    from lantau.engine.tp_workers import check_devices

    config, _ = build_engine_config("random:tiny", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs as many GPUs.*1 visible"):
        check_devices(config, 1)
    check_devices(config, 2)
    cpu, _ = build_engine_config("random:tiny", device="cpu", tensor_parallel_size=2)
    check_devices(cpu, 0)  # the CPU's ranks share it


def test_split_engine_through_preemption(tiny_llama_dir):
    """A KV cache too small for the batch: requests are preempted and resumed (their blocks
    recomputed), and the split engine's greedy tokens still equal the one-rank engine's."""
    from lantau import LLM, SamplingParams
    from tests.test_parity_hf import make_prompts

    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", num_kv_blocks=20, max_model_len=128)
    split = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **common)
    tokens = [o.outputs[0].token_ids for o in split.generate(prompts, params)]
    assert split.engine.core.scheduler.num_preemptions > 0  # or this proves nothing
    assert split.engine.core.kv_cache.num_free_blocks == 20
    del split
    one = LLM(str(tiny_llama_dir), **common)
    assert tokens == [o.outputs[0].token_ids for o in one.generate(prompts, params)]


def test_split_engine_prefix_cache_hits(tiny_llama_dir):
    """A prompt sharing a cached prefix: the hit skips those tokens on every rank (each holds
    its heads of the same blocks), and the tokens equal the one-rank engine's."""
    from lantau import LLM, SamplingParams

    base = [(7 * i) % 500 for i in range(64)]
    prompts = [base + [11, 12], base + [13, 14, 15]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", num_kv_blocks=64)

    def run(llm) -> list[list[int]]:
        return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
                for p in prompts]  # fmt: skip

    split = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **common)
    tokens = run(split)
    assert split.engine.core.scheduler.num_prefix_hit_tokens >= 64
    del split
    assert tokens == run(LLM(str(tiny_llama_dir), **common))


def test_default_model_split_over_three_ranks():
    """The default model's real weights (SmolLM2's GGUF: 9 heads, 3 KV heads) split over 3
    ranks, each dequantizing the file and keeping its slice: the same greedy text."""
    from lantau import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    common = dict(device="cpu", max_model_len=256, num_kv_blocks=64)
    split = LLM(None, tensor_parallel_size=3, **common)
    texts = [o.outputs[0].text for o in split.generate(prompts, params)]
    del split
    one = LLM(None, **common)
    assert texts == [o.outputs[0].text for o in one.generate(prompts, params)]
    assert "Paris" in texts[0]


def test_split_engine_with_an_fp8_kv_cache(tiny_llama_dir):
    """Each rank's e4m3 KV cache of its own heads (per-tensor scales, as one rank's): the
    same greedy tokens as the one-rank engine with the same cache."""
    from lantau import LLM, SamplingParams
    from tests.test_parity_hf import make_prompts

    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8")
    split = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **common)
    assert split.engine.core.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert split.engine.core.runner.kv_caches[0].shape[3] == 1  # 2 KV heads, one a rank
    tokens = [o.outputs[0].token_ids for o in split.generate(prompts, params)]
    del split
    one = LLM(str(tiny_llama_dir), **common)
    assert tokens == [o.outputs[0].token_ids for o in one.generate(prompts, params)]
