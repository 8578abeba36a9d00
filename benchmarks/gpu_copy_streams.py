"""The copies between decode steps on side streams (ModelRunner.use_copy_streams) against on
the compute stream, in one run on the lent GPU (llama3-8b bf16, random weights).

One engine (max_model_len 1152, 256 sequences: W2's short-context graphs as the CLI's, and room
for W5), then:
1. the decode graphs' capture, timed (two turns of every bucket);
2. W2, copy streams on and off, each twice, alternated; the first 32 greedy tokens of each arm
   against the first arm's;
3. 20 W2 decode steps of each arm under torch.profiler: the device's idle time a step (the
   stream-serial work between two graphs) and the largest gaps;
4. the same requests through each arm, tokens (and logprobs) compared: 8 sampled ones (seeded,
   temperature 0.8, top-p 0.9, 3 logprobs) with 8 greedy ones, and 64 W5 prompts (chunked
   prefill steps, eager, between graph steps);
5. W5 with each arm once (output tok/s);
and the copy bandwidth for W2's weight-read floor. Prints a table last.

    PYTHONPATH=. python3 benchmarks/gpu_copy_streams.py [--skip w5]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_w3_host import device_timeline
from lantau import LLM, SamplingParams
from lantau.bench.offline import greedy_agreement, measure_ceilings, run_lantau
from lantau.bench.workloads import make_workload

OUT = os.environ.get("OUT", ".")


def outputs(llm, prompts, params) -> list[tuple]:
    """Each request's tokens and logprobs, from a cold prefix cache."""
    llm.reset_prefix_cache()
    done = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in done]


def engine_timeline(llm, prompt) -> dict:
    """20 decode steps of one W2 request under the profiler (past its prefill)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    engine.add_request("timeline", {"prompt_token_ids": prompt}, params)
    for _ in range(10):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests:
        engine.step()
    return device_timeline(prof, 20, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip", default="", help="comma-separated: capture,w2,timeline,w5")
    skip = set(filter(None, parser.parse_args().skip.split(",")))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    res: dict = {"card": torch.cuda.get_device_name()}
    table: list[str] = []
    ceilings = measure_ceilings(torch.device("cuda"))
    res["ceilings"] = ceilings
    start = time.perf_counter()
    llm = LLM("random:llama3-8b", max_model_len=1152, max_num_seqs=256)
    res["engine_start_s"] = time.perf_counter() - start
    runner = llm.engine.core.runner
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.capture_cuda_graphs()
    res["capture_s"] = time.perf_counter() - start
    graphs = runner.graphs
    res["graphs"] = sum(len(t.graphs) + len(t.short_graphs) for t in graphs.turns)
    table.append(
        f"| decode graphs' capture | {res['capture_s']:.1f} s | {res['graphs']} graphs (two "
        f"turns); engine start {res['engine_start_s']:.1f} s |"
    )
    print(table[-1], flush=True)
    weight_bytes = sum(
        p.numel() * p.element_size()
        for name, p in runner.model.named_parameters()
        if "embed_tokens" not in name
    )
    floor_ms = weight_bytes / (ceilings["copy_tb_s"] * 1e12) * 1e3
    res["floor_ms"] = floor_ms

    w2 = make_workload("W2", 128256)
    check = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    reference = None
    for on in (True, False, True, False) if "w2" not in skip else ():
        runner.use_copy_streams(on)
        tokens, same = greedy_agreement(llm, w2.prompts[0], reference)
        reference = reference or tokens
        stats = run_lantau(llm, w2).summary()
        res.setdefault("w2", []).append({"copy_streams": on, "greedy_same": same, **stats})
        table.append(
            f"| W2, copy streams {'on' if on else 'off'} | {stats['ms_per_token']:.3f} ms/token "
            f"| floor {floor_ms:.3f} ms ({ceilings['copy_tb_s']} TB/s copy); GPU util "
            f"{stats['gpu_util_pct']}%; {same}/32 greedy tokens as the first arm's |"
        )
        print(table[-1], flush=True)

    for on in (True, False) if "timeline" not in skip else ():
        runner.use_copy_streams(on)
        tl = engine_timeline(llm, w2.prompts[0])
        res.setdefault("timeline", []).append({"copy_streams": on, **tl})
        table.append(
            f"| W2 engine, 20 decode steps, copy streams {'on' if on else 'off'} | device idle "
            f"{1e3 * tl['idle_ms_per_step']:.1f} us a step | busy "
            f"{tl['busy_ms_per_step']:.3f} ms; largest gaps {tl['largest_gaps_us'][:3]} |"
        )
        print(table[-1], flush=True)

    sampled = SamplingParams(
        temperature=0.8, top_p=0.9, seed=11, logprobs=3, max_tokens=24, ignore_eos=True,
        detokenize=False,
    )  # fmt: skip
    mixed = [sampled] * 8 + [check] * 8
    w5 = make_workload("W5", 128256)
    arms = {}
    for on in (True, False):
        runner.use_copy_streams(on)
        arms[on] = (
            outputs(llm, w5.prompts[64:80], mixed),
            outputs(llm, w5.prompts[:64], check),
        )
    equal_mixed = sum(a == b for a, b in zip(*(arms[on][0] for on in (True, False)), strict=True))
    equal_w5 = sum(a == b for a, b in zip(*(arms[on][1] for on in (True, False)), strict=True))
    res["equal"] = {"mixed_16": equal_mixed, "w5_64": equal_w5}
    table.append(
        f"| same requests, copy streams on vs off | {equal_mixed}/16 sampled+greedy with "
        f"logprobs, {equal_w5}/64 W5 prompts equal | bitwise: the graphs are the same |"
    )
    print(table[-1], flush=True)

    if "w5" not in skip:
        for on in (True, False):
            runner.use_copy_streams(on)
            stats = run_lantau(llm, w5).summary()
            res.setdefault("w5", []).append({"copy_streams": on, **stats})
            table.append(
                f"| W5, copy streams {'on' if on else 'off'} | {stats['output_tok_s']:.0f} "
                f"tok/s | GPU util {stats['gpu_util_pct']}%, P95 e2e {stats['e2e_p95_s']} s |"
            )
            print(table[-1], flush=True)
    runner.use_copy_streams(True)
    with open(os.path.join(OUT, "gpu_copy_streams.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| what | figure | comparison |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
