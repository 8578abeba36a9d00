"""The CUDA graphs' forward pass, run on CPU without capture: what a replay computes from the
staged buffers (two copies, padding rows, input tokens picked on the device from the previous
step's samples) gives the eager step's logits, step after step of an overlapped run, and its
greedy pick each row's argmax."""

from __future__ import annotations

import random

import torch

from lantau import LLM, SamplingParams
from lantau.runner.cuda_graph import CudaGraphRunner


def test_graph_forward_from_staged_inputs_matches_eager(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
        attention_backend="triton",
    )  # fmt: skip
    runner = llm.engine.core.runner
    graphs = CudaGraphRunner(
        runner.config, runner.model, runner.kv_caches, runner.device, runner.prev_token_ids
    )
    assert graphs.batch_sizes == [1, 2, 4, 8]
    graphs.greedy_in_graph = True  # the graph's greedy pick too (the default)
    checked = []
    eager_forward = runner._forward_logits

    def both(inputs):
        # the graph's pass first: on CPU the eager pass writes the device-sampled tokens into
        # inputs.input_ids (no copy to a device), which would hide a wrong pick here
        replayed = None
        if graphs.can_run(inputs):
            bs = graphs.bucket(inputs.num_reqs)
            graphs.stage(inputs, bs)
            before = runner.prev_token_ids.clone()
            replayed, greedy = graphs._step(bs)
            # the graph's greedy pick: each row's argmax, left in prev_token_ids for the next
            # step (restored here: the eager pass below reads this step's inputs from it)
            assert torch.equal(greedy, replayed.argmax(dim=-1))
            assert torch.equal(runner.prev_token_ids[:bs], greedy)
            runner.prev_token_ids.copy_(before)
            checked.append((inputs.num_reqs, bs, len(inputs.pending_rows)))
        # the eager pass recomputes the step: same KV slots, same values (padding writes none)
        logits = eager_forward(inputs)
        if replayed is not None:
            n = len(inputs.sample_ids)
            torch.testing.assert_close(replayed[:n], logits, rtol=1e-5, atol=1e-5)
        return logits

    runner._forward_logits = both
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 12, 3)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # decode steps of 3 rows (bucket 4: a padding row), then 2, then 1; their input tokens
    # came from the device (overlapped scheduling), so the graph picked them itself
    assert {(3, 4), (2, 2), (1, 1)} <= {(n, bs) for n, bs, _ in checked}
    assert all(pending == n for n, _, pending in checked)
