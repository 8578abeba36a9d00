"""The CUDA graphs' forward pass, run on CPU without capture: what a replay computes from the
staged buffers (each turn's, padding rows, input tokens picked on the device from the previous
step's samples in the other turn's ids buffer) gives the eager step's logits, step after step
of an overlapped run, and its greedy pick each row's argmax."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from lantau import LLM, SamplingParams
from lantau.config import KernelConfig
from lantau.runner.cuda_graph import CudaGraphRunner
from lantau.runner.mixed_graph import MixedGraphRunner
from tests.conftest import hf_greedy


@pytest.mark.parametrize("short_keys", [0, 26])
def test_graph_forward_from_staged_inputs_matches_eager(tiny_llama_dir, short_keys):
    """short_keys: decode attention's short-context tile (KernelConfig.attn_short_tile) on, so
    that batches whose contexts all fit in 26 keys run the short-context graphs (contexts here
    run from 5 to 29 keys); 0: off. The batch-1 GEMV is off: the graphs' staging is the
    question here (the GEMV has its own tests), and it was two thirds of this test's time."""
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
        attention_backend="triton",
        kernels=KernelConfig(
            attn_short_tile=(8, 4, 1), attn_short_keys=short_keys, enable_gemv=False
        ),
    )  # fmt: skip
    runner = llm.engine.core.runner
    ops = runner.model.ops
    graphs = CudaGraphRunner(
        runner.config, runner.model, runner.kv_caches, runner.device, runner.token_ids
    )
    assert graphs.batch_sizes == [1, 2, 4, 8]
    checked, classes, turns = [], set(), []
    eager_forward = runner._forward_logits
    num_layers = len(runner.model.model.layers)
    norms = []  # each add_rms_norm a graph step runs: whether its weight is a layer's
    layer_norms = {
        id(norm.weight)
        for layer in runner.model.model.layers
        for norm in (layer.input_layernorm, layer.post_attention_layernorm)
    }
    add_rms_norm = ops.add_rms_norm

    def counting_add_rms_norm(x, residual, weight, eps, next_layer=None):
        norms.append(id(weight) in layer_norms)
        return add_rms_norm(x, residual, weight, eps, next_layer)

    ops.add_rms_norm = counting_add_rms_norm

    def both(inputs):
        # the graph's pass first: on CPU the eager pass writes the device-sampled tokens into
        # inputs.input_ids (no copy to a device), which would hide a wrong pick here
        replayed = None
        if graphs.can_run(inputs):
            bs = graphs.bucket(inputs.num_reqs)
            turn = 1 - runner._last  # the ids buffer this step writes, as launch() picks it
            graphs.stage(inputs, bs, turn)
            before = [ids.clone() for ids in runner.token_ids]
            # the graph run() would pick: the short-context one if every context fits
            short = int(inputs.seq_lens.max()) <= ops.short_context_keys(bs)
            norms.clear()
            replayed, greedy = graphs._step(bs, ops.short_context_keys(bs) if short else None, turn)
            # decode_logits: every layer's add + norm, and the last residual add with the final
            # norm (no separate add, no separate norm launch)
            assert norms == [True] * (2 * num_layers - 1) + [False], norms
            # every bucket's logits: the first rows of its turn's one buffer (a buffer a
            # bucket held sum(buckets) rows of vocab_size: 18 GiB at 768 sequences of llama3)
            assert replayed.data_ptr() == graphs.turns[turn].logits.data_ptr()
            assert replayed.shape == (bs, graphs.turns[turn].logits.shape[1])
            classes.add(short)
            turns.append(turn)
            # the graph's greedy pick: each row's argmax, left in its turn's ids buffer for the
            # next step (restored here: the sampler writes it there after the eager pass), the
            # other turn's buffer, which it read, untouched
            assert torch.equal(greedy, replayed.argmax(dim=-1))
            assert torch.equal(runner.token_ids[turn][:bs], greedy)
            assert torch.equal(runner.token_ids[1 - turn], before[1 - turn])
            runner.token_ids[turn].copy_(before[turn])
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
    # consecutive decode steps alternate the turns (each writes the buffer the last one read)
    assert all(a != b for a, b in zip(turns, turns[1:], strict=False)) and set(turns) == {0, 1}
    # without the short config every batch takes the long graphs; with it, both kinds ran
    assert classes == ({False, True} if short_keys else {False})
    if short_keys:  # run()'s choice of graph, on stand-ins (capture needs CUDA)
        for turn, inp in enumerate(graphs.turns):
            inp.graphs[2], inp.short_graphs[2] = ("long", turn, None), ("short", turn, None)
            inp.graphs[16] = ("long", turn, None)  # above attn_small_rows: no short graph
        fits = SimpleNamespace(
            seq_lens=np.array([short_keys, 3], dtype=np.int32), has_adapter_rows=False
        )
        over = SimpleNamespace(
            seq_lens=np.array([short_keys + 1, 3], dtype=np.int32), has_adapter_rows=False
        )
        for turn in (0, 1):
            assert graphs.pick(fits, 2, turn)[:2] == ("short", turn)
            assert graphs.pick(over, 2, turn)[:2] == ("long", turn)
            sixteen = SimpleNamespace(seq_lens=np.array([3] * 16), has_adapter_rows=False)
            assert graphs.pick(sixteen, 16, turn)[:2] == ("long", turn)


def test_a_short_model_captures_one_graph_a_bucket(tiny_llama_dir, monkeypatch):
    """A model shorter than KernelConfig.attn_short_keys (max_model_len 48, the default 1,024
    keys) gets no second, short-context graphs: its one graph a bucket, bounded by the model's
    length, takes the short config itself (a graph bounded by 1,024 keys failed the attention's
    block-table check here, and one bounded by 48 would have been the same graph twice)."""
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=48,
        max_num_seqs=2, attention_backend="triton",
    )  # fmt: skip
    runner = llm.engine.core.runner
    ops = runner.model.ops
    assert ops.short_context_keys(1) == 1024  # the default: on
    graphs = CudaGraphRunner(
        runner.config, runner.model, runner.kv_caches, runner.device, runner.token_ids
    )
    assert graphs.short_keys(1) == 0 and graphs.short_keys(2) == 0
    configs = []

    class Spy:  # the attention module, recording each decode launch's tiling
        def __getattr__(self, name):
            return getattr(real, name)

        def paged_decode_attention(self, *args, **kwargs):
            configs.append(kwargs["config"])
            return real.paged_decode_attention(*args, **kwargs)

    real = ops._decode
    monkeypatch.setattr(ops, "_decode", Spy())
    for inp in graphs.turns:  # as capture() does
        inp.seq_lens.fill_(1)
        inp.slot_mapping.fill_(-1)
        inp.pending_src.fill_(-1)
    logits, greedy = graphs._step(2, None, turn=1)  # what the bucket's graph runs
    assert logits.shape == (2, runner.model.config.vocab_size) and logits.isfinite().all()
    assert torch.equal(greedy, logits.argmax(dim=-1))
    assert configs and set(configs) == {ops.config.attn_short_tile}


def test_mixed_graph_forward_from_staged_inputs_matches_eager(tiny_llama_dir):
    """The mixed steps' graphs (runner/mixed_graph.py), run on CPU without capture: the model's
    body on the staged buffers, padded to the step's token bucket with empty requests, and
    the previous step's device-sampled tokens written in, gives the eager step's logits; and
    the greedy tokens are HF's, as the engine's are. The eager steps attend their leading
    decodes apart (AttentionMetadata.num_decodes: running requests lead a step's rows)."""
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=4,
        max_num_batched_tokens=80, attention_backend="triton",
    )  # fmt: skip
    runner = llm.engine.core.runner
    graphs = MixedGraphRunner(runner.config, runner.model, runner.kv_caches, runner.device)
    assert graphs.buckets == [64, 80] and graphs.max_reqs == 4
    eager_forward, checked = runner._forward_logits, []

    def both(inputs):
        replayed = None
        if graphs.can_run(inputs):  # the graph's pass first (see the decode test above)
            num_tokens = graphs.bucket(len(inputs.input_ids))
            graphs.stage(inputs, num_tokens)
            runner.fill_pending(graphs.input_ids[:num_tokens], inputs)
            replayed = runner._sample_logits(graphs.forward(num_tokens), inputs)
            checked.append((len(inputs.input_ids), num_tokens, inputs.num_reqs))
        logits = eager_forward(inputs)
        if replayed is not None:
            torch.testing.assert_close(replayed, logits, rtol=1e-5, atol=1e-5)
        return logits

    runner._forward_logits = both
    ops, decodes_apart = runner.model.ops, []
    attention = ops.attention

    def recording_attention(q, kv_cache, meta, scale, **kw):
        if not meta.is_decode_only:
            decodes_apart.append(meta.num_decodes)
        return attention(q, kv_cache, meta, scale, **kw)

    ops.attention = recording_attention
    rng = random.Random(11)
    lengths = (70, 9, 30, 3)  # 70: a chunk of 80 - decodes, then the rest
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = llm.engine
    engine.add_request("r0", {"prompt_token_ids": prompts[0]}, params)
    engine.add_request("r1", {"prompt_token_ids": prompts[1]}, params)
    results = {}
    for step in range(40):  # the rest arrive while the first ones decode: mixed steps
        if step in (2, 3):
            for i in (2,) if step == 2 else (3,):
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests:
            break
    assert len(results) == 4
    # steps of both buckets ran, with padding tokens and padding requests, beside decodes
    assert {64, 80} <= {bucket for _, bucket, _ in checked}
    assert any(n < bucket for n, bucket, _ in checked)
    assert any(reqs > 1 for *_, reqs in checked)
    assert max(decodes_apart) >= 1 and 0 in decodes_apart  # and first steps of prompts alone
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"] == hf_greedy(model, prompt, 3)[0], i
