"""The last layer computed for the sampling rows only (ForwardContext.keep): a step with prompt
rows writes every row's keys and values in its last layer, but attends, projects and runs the
MLP for the rows whose output is read (each request's last row that samples). Against the same
step computed for every row, on the same model and cache: the kept rows' outputs match, the
caches match bit for bit, a step that samples nothing returns no rows; both backends (the
triton one in the interpreter) and an fp8 cache (its kept rows then attend over the cache's
rounded keys, not the step's own: within the cache's quantization error). The engine takes
this path for its eager steps with prompt rows and still gives HF transformers' tokens
(tests/test_parity_hf.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from lantau.kernels.reference import FP8_KV_DTYPE  # noqa: E402
from lantau.model.forward_context import AttentionMetadata, ForwardContext, KeptRows  # noqa: E402
from lantau.model.loader import build_model, read_model_config, resolve_model_source  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot", "interpreter_fp8_cast")

BLOCK_SIZE, BLOCKS_PER_REQ = 16, 2
# (tokens in the cache before the step, tokens in the step, whether its last row samples):
# a decode, a prompt's chunk that does not end it, a fresh prompt, a chunk that ends its prompt
STEP = [(9, 1, True), (5, 4, False), (0, 7, True), (3, 6, True)]


def _meta(reqs: list[tuple[int, int]], owners: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of a step of (context before, new tokens) per request, request i being STEP's
    request owners[i] (it owns cache blocks 2 owners[i] and 2 owners[i] + 1); and the step's
    positions."""
    positions = torch.cat([torch.arange(c, c + n) for c, n in reqs])
    row_req = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(reqs)])
    lens = torch.tensor([n for _, n in reqs])
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    tables = torch.tensor(
        [[BLOCKS_PER_REQ * o + b for b in range(BLOCKS_PER_REQ)] for o in owners],
        dtype=torch.int32,
    )
    slots = tables[row_req, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=tables, max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
    )  # fmt: skip
    return meta, positions


def _kept(meta: AttentionMetadata, sampled: list[bool]) -> KeptRows:
    """The last row of each sampling request, as the runner keeps them."""
    reqs = torch.tensor([i for i, s in enumerate(sampled) if s], dtype=torch.int64)
    rows = meta.query_start_loc[1:].long()[reqs] - 1
    longest = int(meta.seq_lens[reqs].max()) if len(reqs) else 0
    return KeptRows.of(meta, rows, reqs, longest)


@pytest.mark.parametrize(
    ("ops", "cache_dtype"),
    [("torch", torch.float32), ("triton", torch.float32), ("triton", FP8_KV_DTYPE)],
)
@pytest.mark.parametrize("sampled", [[s for _, _, s in STEP], [False] * len(STEP)])
def test_last_layer_of_the_sampling_rows_matches_every_row(ops, cache_dtype, sampled):
    source = resolve_model_source("random:tiny")
    config = read_model_config(source)
    model = build_model(source, config, torch.float32, torch.device("cpu"), seed=11, ops=ops)
    attn = model.model.layers[0].self_attn
    shape = (2, len(STEP) * BLOCKS_PER_REQ, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(config.num_hidden_layers)]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        # what the step's requests hold before it, computed as a step of its own
        held = [i for i, (c, _, _) in enumerate(STEP) if c]
        meta, positions = _meta([(0, STEP[i][0]) for i in held], held)
        ids = torch.randint(3, config.vocab_size, (len(positions),), generator=gen)
        model(ids, ForwardContext(meta, caches, positions))

        meta, positions = _meta([(c, n) for c, n, _ in STEP], list(range(len(STEP))))
        ids = torch.randint(3, config.vocab_size, (len(positions),), generator=gen)
        every = [c.clone() for c in caches]
        hidden = model(ids, ForwardContext(meta, every, positions))
        keep = _kept(meta, sampled)
        ctx = ForwardContext(meta, caches, positions)
        ctx.keep = keep
        kept = model(ids, ctx)

    assert kept.shape == (len(keep.rows), config.hidden_size)
    for got, want in zip(caches, every, strict=True):  # every row's keys and values, exactly
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if not len(keep.rows):
        return
    want = hidden[keep.rows]
    err = ((kept - want).norm() / want.norm()).item()
    # fp32 cache: the same keys, another kernel's summation order; fp8: the kept rows read the
    # cache's e4m3 keys and values where every-row's fresh prompts read the step's own
    assert err < (1.5e-2 if cache_dtype == FP8_KV_DTYPE else 1e-5), err


def test_the_engine_keeps_the_sampling_rows_of_steps_with_prompt_rows(monkeypatch):
    """Eager steps with prompt rows run the last layer for their sampling rows (a chunk that
    does not end its prompt: none); decode-only steps compute every row as before; the tokens
    are the full computation's (the torch backend, greedy)."""
    from lantau import LLM, SamplingParams
    from lantau.model.llama import LlamaForCausalLM

    seen = []
    forward = LlamaForCausalLM.forward

    def spy(self, input_ids, ctx, *args, **kwargs):
        seen.append((len(input_ids), None if ctx.keep is None else len(ctx.keep.rows)))
        return forward(self, input_ids, ctx, *args, **kwargs)

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (20, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(
        "random:tiny", device="cpu", max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=256
    )
    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    kept = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # chunks of 16 tokens: the first ends no prompt, the second ends both (beside a decode of
    # none yet), then decodes of both
    assert seen[0] == (16, 0) and seen[1] == (7, 2), seen
    assert all(keep is None for n, keep in seen[2:]), seen
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    monkeypatch.setattr(
        "lantau.runner.model_runner.ModelRunner._forward_logits",
        lambda self, inputs: self._sample_logits(self._forward(inputs), inputs),
    )
    every = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert kept == every
