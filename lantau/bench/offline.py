"""`lantau bench offline`: the in-process engine on a standard workload, with the card's
ceilings and (optionally) HF transformers `generate` measured in the same run."""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from lantau.bench.monitor import GpuUtilSampler
from lantau.bench.workloads import Workload, make_workload
from lantau.kv_cache.manager import cdiv
from lantau.request import SamplingParams


@dataclass
class RunStats:
    name: str
    num_prompts: int
    output_tokens: int
    elapsed_s: float
    e2e_s: list[float] = field(default_factory=list)  # per request, from the run's start
    ttft_s: list[float] = field(default_factory=list)
    gpu_util_pct: float | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def ms_per_token(self) -> float:
        """Mean time between output tokens of one request (decode speed, TTFT excluded)."""
        per_req = self.output_tokens / max(self.num_prompts, 1)
        if per_req <= 1 or not self.ttft_s:
            return 1000 * self.elapsed_s / max(per_req, 1)
        decode = statistics.mean(e - t for e, t in zip(self.e2e_s, self.ttft_s, strict=True))
        return 1000 * decode / (per_req - 1)

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict:
        return {
            "name": self.name,
            "num_prompts": self.num_prompts,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "output_tok_s": round(self.output_tok_s, 1),
            "ms_per_token": round(self.ms_per_token, 3),
            "e2e_p50_s": round(self.percentile(self.e2e_s, 0.50), 3),
            "e2e_p95_s": round(self.percentile(self.e2e_s, 0.95), 3),
            "ttft_p50_s": round(self.percentile(self.ttft_s, 0.50), 3),
            "gpu_util_pct": self.gpu_util_pct,
        }


def measure_ceilings(device: torch.device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written), the bf16 matmul rate and, where
    the GPU has them, row-wise-scaled fp8 matmuls' (`_scaled_mm`, bf16 out), with and without
    fast accumulation."""
    if device.type != "cuda":
        return {}
    n = 1 << 30  # 2 GiB of bf16 per buffer
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    copy_ms = _time_cuda(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_ms = _time_cuda(lambda: x @ y)
    ceilings = {
        "copy_tb_s": round(2 * n * 2 / copy_ms / 1e9, 3),
        "bf16_matmul_tflop_s": round(2 * 8192**3 / mm_ms / 1e9, 1),
    }
    if torch.cuda.get_device_capability(device) >= (8, 9):
        from lantau.model.fp8 import quantize_rows, scaled_mm

        (xq, xs), (yq, ys) = quantize_rows(x), quantize_rows(y)
        # the engine's fp8 projections accumulate fast (model/fp8.py)
        for key, fast in (("fp8_matmul_tflop_s", False), ("fp8_fast_matmul_tflop_s", True)):
            fp8_ms = _time_cuda(lambda fast=fast: scaled_mm(xq, xs, yq, ys, fast))
            ceilings[key] = round(2 * 8192**3 / fp8_ms / 1e9, 1)
    return ceilings


def _time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 50) -> float:
    """Mean GPU time of one replay of a captured graph, replayed back to back."""
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def batch1_graph(graphs, keys: int, block_size: int) -> torch.cuda.CUDAGraph:
    """The captured batch-1 decode graph (a CudaGraphRunner's) that serves `keys` keys (its
    short-context one if they fit), its row set to them on cache blocks 0, 1, ... and writing no
    KV: the graph to time alone."""
    num_blocks = cdiv(keys, block_size)
    graphs.seq_lens[:1].fill_(keys)
    graphs.block_tables[0, :num_blocks] = torch.arange(
        num_blocks, dtype=torch.int32, device=graphs.block_tables.device
    )
    graphs.slot_mapping[:1].fill_(-1)
    short = keys <= graphs.short_keys(1)
    return (graphs.short_graphs if short else graphs.graphs)[1][0]


def graph_ms(fn, iters: int = 20) -> float:
    """Mean GPU time of fn, captured as one CUDA graph (no launch gaps) and replayed."""
    fn()  # warm-up: compiles, settles the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, iters)


def greedy_agreement(llm, prompt_token_ids: list[int], reference: list[int] | None, n: int = 32):
    """The first n greedy tokens of one prompt from a cold prefix cache, and how many of them
    lead as in `reference` (n if it is None): the check between same-run arms of a knob."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": prompt_token_ids}, params)
    tokens = out[0].outputs[0].token_ids
    reference = reference or tokens
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), n)
    return tokens, same


def warm_up(llm, workload: Workload) -> SamplingParams:
    """The workload's first prompts (as many as run at once) through the engine, for its own
    shapes (kernel specializations, allocator), then a cold prefix cache; returns the timed
    run's sampling parameters (greedy, the workload's length, no text)."""
    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    num_warm = llm.config.scheduler.max_num_seqs
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:num_warm]], warm)
    llm.reset_prefix_cache()
    return SamplingParams(
        temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True, detokenize=False
    )


def run_lantau(llm, workload: Workload, on_start=None) -> RunStats:
    """All requests at once; per-request TTFT and end-to-end from the run's start.

    A warm-up on the workload's own first prompts (as many as run at once) comes first, then
    the prefix cache is reset; `on_start()` is called right before the timed run."""
    engine = llm.engine
    params = warm_up(llm, workload)
    if on_start is not None:
        on_start()
    ttft: dict[str, float] = {}
    e2e: dict[str, float] = {}
    num_tokens = 0
    with GpuUtilSampler() as util:
        start = time.perf_counter()
        for i, prompt in enumerate(workload.prompts):
            engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests:
            outputs = engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                ttft.setdefault(out.request_id, now)
                if out.finished:
                    e2e[out.request_id] = now
                    num_tokens += len(out.outputs[0].token_ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    ids = sorted(e2e)
    return RunStats(
        "lantau", len(ids), num_tokens, elapsed, [e2e[i] for i in ids], [ttft[i] for i in ids],
        util.mean,
    )  # fmt: skip


def hf_config_of(model_config):
    import transformers

    m = model_config
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        rope = {"rope_theta": m.rope_theta, **asdict(m.rope_scaling)}
    return transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        rms_norm_eps=m.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
    )


def run_hf_peer(model_config, workload: Workload, device: torch.device, static: bool) -> RunStats:
    """HF transformers `generate` in static batches of workload.peer_batch prompts."""
    import transformers

    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config_of(model_config)).to(torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    extra = {"cache_implementation": "static"} if static else {}
    num_tokens, e2e = 0, []
    with GpuUtilSampler() as util, torch.inference_mode():
        batch = torch.tensor(workload.prompts[: workload.peer_batch], device=device)
        model.generate(batch, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, workload.num_prompts, workload.peer_batch):
            ids = workload.prompts[i : i + workload.peer_batch]
            if len({len(p) for p in ids}) != 1:
                raise ValueError("the HF peer needs equal-length prompts")
            out = model.generate(
                torch.tensor(ids, device=device),
                attention_mask=torch.ones(len(ids), len(ids[0]), dtype=torch.long, device=device),
                max_new_tokens=workload.max_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
            torch.cuda.synchronize()
            num_tokens += (out.shape[1] - len(ids[0])) * len(ids)
            e2e += [time.perf_counter() - start] * len(ids)
        elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    name = "hf-static" if static else "hf"
    return RunStats(name, len(e2e), num_tokens, elapsed, e2e, [], util.mean)


def engine_sizes(
    workload_name: str, max_num_seqs: int | None, max_num_batched_tokens: int | None
) -> tuple[int, int | None]:
    """max_num_seqs and the step's token budget for a workload, where not given: the W3 rows
    (throughput, all prompts at once) run 384 sequences and 65,536-token steps, the fastest of
    the budgets the H200 runs compared (benchmarks/RESULTS.md: W3-bf16-1000; longer steps run
    the prefill's matmuls nearer their peak); others 256 and the engine's default budget."""
    if workload_name.startswith("W3"):
        return max_num_seqs or 384, max_num_batched_tokens or 65536
    return max_num_seqs or 256, max_num_batched_tokens


def bench_offline(args) -> dict:
    from lantau.engine.args import build_engine_config, resolve_device
    from lantau.llm import LLM

    dtype = getattr(args, "dtype", "auto")
    config, _ = build_engine_config(args.model, dtype=dtype, device="auto")
    config = resolve_device(config, torch.cuda.is_available())
    workload = make_workload(args.workload, config.model_config.vocab_size, args.num_prompts)
    device = torch.device(config.device)
    result = {
        "workload": workload.name,
        "model": args.model,
        "dtype": dtype,
        "ceilings": measure_ceilings(device),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ceilings' buffers
    if device.type == "cuda":
        result["card"] = torch.cuda.get_device_name(device)
    peers = []
    for peer in args.peer or []:
        num = args.peer_prompts or workload.num_prompts
        sub = Workload(
            workload.name, workload.prompts[:num], workload.max_tokens, workload.peer_batch
        )
        peers.append(run_hf_peer(config.model_config, sub, device, static=peer == "hf-static"))
    max_len = max(len(p) for p in workload.prompts) + workload.max_tokens
    max_num_seqs, max_num_batched_tokens = engine_sizes(
        workload.name, args.max_num_seqs, args.max_num_batched_tokens
    )
    llm = LLM(
        args.model,
        dtype=dtype,
        max_model_len=max(max_len, args.max_model_len or 0),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.90),
        seed=getattr(args, "seed", 0),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        enable_chunked_prefill=getattr(args, "enable_chunked_prefill", True),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        scheduling_policy=getattr(args, "scheduling_policy", "max_utilization"),
        long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", 0),
        async_scheduling=getattr(args, "async_scheduling", True),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
    )
    segments_before = _num_segments(device)
    ours = run_lantau(llm, workload)
    result["lantau"] = ours.summary()
    result["new_segments_during_run"] = _num_segments(device) - segments_before
    cache = llm.config.cache
    result["kv_blocks"] = cache.num_blocks
    result["kv_cache_dtype"] = cache.kv_cache_dtype
    result["kv_tokens"] = cache.num_blocks * cache.block_size  # the cache's token capacity
    sched = llm.config.scheduler
    result["engine"] = {
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "tensor_parallel_size": llm.config.tensor_parallel_size,
    }
    result["peers"] = [p.summary() for p in peers]
    return result


def _num_segments(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("segment.all.allocated", 0)


def print_report(result: dict) -> None:
    print(json.dumps(result, indent=1))
    rows = [result["lantau"], *result["peers"]]
    print(f"\n{result['workload']} on {result.get('card', 'cpu')}, ceilings {result['ceilings']}")
    if "kv_tokens" in result:
        print(f"KV cache: {result['kv_cache_dtype']}, {result['kv_tokens']:,} tokens")
    print(f"{'run':<10} {'tok/s':>10} {'ms/tok':>8} {'p50 e2e':>8} {'p95 e2e':>8} {'gpu %':>6}")
    for r in rows:
        print(
            f"{r['name']:<10} {r['output_tok_s']:>10.1f} {r['ms_per_token']:>8.2f} "
            f"{r['e2e_p50_s']:>8.2f} {r['e2e_p95_s']:>8.2f} {r['gpu_util_pct'] or 0:>6}"
        )
