"""Sampler: greedy, seeded reproducibility, sampled distributions, penalties, logit bias,
logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lantau.errors import InvalidRequestError
from lantau.request import SamplingParams
from lantau.sampling import Sampler, SamplingRow, apply_penalties, process_logits


def make_row(
    generator: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: object,
) -> SamplingRow:
    prompt = [0] if prompt is None else prompt
    return SamplingRow(
        SamplingParams(**params), generator, prompt, [] if output is None else output
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=seeded(0))
    out = Sampler()(logits, [make_row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_accepts_half_precision_logits() -> None:
    logits = torch.randn(3, 40, generator=seeded(1)).to(torch.bfloat16)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie: the first index wins
    out = Sampler()(logits, [make_row(temperature=0.0) for _ in range(3)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[1] == 7


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    logits = torch.randn(8, 30, generator=seeded(2))
    gens = [seeded(100 + i) for i in range(8)]
    states = [g.get_state() for g in gens]
    rows = [make_row(gens[i], temperature=0.0 if i % 2 == 0 else 1.0, top_k=5) for i in range(8)]
    out = Sampler()(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    top5 = logits.topk(5, dim=-1).indices.tolist()
    for i in range(8):
        if i % 2 == 0:
            assert out.token_ids[i] == argmax[i]
            # greedy rows leave their generator untouched
            assert torch.equal(gens[i].get_state(), states[i])
        else:
            assert out.token_ids[i] in top5[i]
            assert not torch.equal(gens[i].get_state(), states[i])


def test_greedy_takes_a_pick_made_already_only_when_it_applies() -> None:
    """The CUDA graph's argmax (greedy_ids) is the token_ids of an all-greedy batch without
    penalties, the same tensor (the runner then skips its copy); any other batch samples
    from the logits as usual."""
    logits = torch.randn(4, 30, generator=seeded(3))
    picked = logits.argmax(dim=-1)
    rows = [make_row(temperature=0.0) for _ in range(4)]
    pending = Sampler().sample(logits, rows, greedy_ids=picked)
    assert pending.token_ids is picked
    assert pending.resolve().token_ids == picked.tolist()
    wrong = torch.zeros(4, dtype=torch.long)  # were it used, these rows would come out 0
    penalized = [make_row(temperature=0.0, output=[int(t)], repetition_penalty=5.0) for t in picked]
    for batch in (penalized, [*rows[:2], make_row(seeded(1), temperature=1.0, top_k=1), rows[3]]):
        pending = Sampler().sample(logits, batch, greedy_ids=wrong)
        assert pending.token_ids is not wrong
    out = Sampler().sample(
        logits,
        rows[:2] + [make_row(seeded(1), temperature=1.0, top_k=1)] + rows[3:],
        greedy_ids=wrong,
    )
    assert out.resolve().token_ids == picked.tolist()  # top_k=1 samples the argmax too


# --- seeded reproducibility ---------------------------------------------------------------


def test_same_seeds_give_same_tokens_across_samplers() -> None:
    logits = torch.randn(6, 100, generator=seeded(3))

    def run(sampler_seed: int) -> list[int]:
        rows = [make_row(seeded(7 + i) if i < 3 else None, top_p=0.9) for i in range(6)]
        return Sampler(seed=sampler_seed)(logits, rows).token_ids

    assert run(11) == run(11)
    first = run(11)
    # seeded rows ignore the shared generator; unseeded ones follow it
    others = [run(s) for s in range(12, 17)]
    assert all(o[:3] == first[:3] for o in others)
    assert any(o[3:] != first[3:] for o in others)


def _track_row_logits(step: int, vocab: int) -> torch.Tensor:
    # fairly flat logits so the sampled token actually varies from step to step
    return torch.randn(vocab, generator=seeded(1000 + step)) * 0.5


def test_seeded_row_is_independent_of_batch_composition() -> None:
    vocab, steps = 64, 20

    def tracked(gen: torch.Generator, output: list[int]) -> SamplingRow:
        return make_row(
            gen,
            prompt=[1, 2, 3],
            output=output,
            temperature=0.8,
            top_k=40,
            top_p=0.95,
            frequency_penalty=0.3,
        )

    alone_gen, alone_out = seeded(42), []
    for step in range(steps):
        out = Sampler(seed=0)(_track_row_logits(step, vocab)[None], [tracked(alone_gen, alone_out)])
        alone_out.append(out.token_ids[0])
    assert len(set(alone_out)) > 3  # really sampling, not stuck on one token

    batched_gen, batched_out = seeded(42), []
    sampler = Sampler(seed=5)
    other_gens = [seeded(900 + i) for i in range(3)]
    noise = seeded(77)
    for step in range(steps):
        num_rows = 2 + step % 5
        position = step % num_rows
        others = [
            make_row(
                other_gens[i % 3] if i % 2 else None,
                temperature=[0.0, 1.0, 1.3][i % 3],
                min_p=0.05 * (i % 2),
                repetition_penalty=1.2,
            )
            for i in range(num_rows - 1)
        ]
        rows = others[:position] + [tracked(batched_gen, batched_out)] + others[position:]
        logits = torch.randn(num_rows, vocab, generator=noise)
        logits[position] = _track_row_logits(step, vocab)
        batched_out.append(sampler(logits, rows).token_ids[position])
    assert batched_out == alone_out


# --- sampled distributions ----------------------------------------------------------------

LOGITS = [2.0, 1.5, 1.1, 0.8, 0.3, 0.0, -0.4, -0.9, -1.3, -2.0, 0.5, 1.8]


def reference_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The exact target distribution, written independently of the sampler (float64)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = sorted(np.flatnonzero(keep), key=lambda i: -p[i])
    if top_k > 0:
        order = order[:top_k]
    q = p[order] / p[order].sum()
    if top_p < 1.0:
        # smallest prefix of the most likely tokens whose mass reaches top_p
        n = int(np.searchsorted(np.cumsum(q), top_p)) + 1
        order = order[:n]
    out = np.zeros_like(p)
    out[order] = p[order]
    return out / out.sum()


CONFIGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
    # each filter binds: min_p keeps 6 tokens, top_k 5 of them, top_p 4 of those
    "combined": dict(temperature=1.3, min_p=0.3, top_k=5, top_p=0.85),
}


def assert_matches(tokens: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(np.asarray(tokens), minlength=len(expected)).astype(np.float64)
    masked = expected == 0
    assert counts[masked].sum() == 0, f"masked tokens sampled: {np.flatnonzero(counts * masked)}"
    n = counts.sum()
    freq = counts / n
    assert np.abs(freq - expected).max() < 0.01, (freq, expected)
    kept = ~masked
    chi2 = (((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum()
    df = kept.sum() - 1
    # ~6 standard deviations above the chi-square mean: deterministic seeds, generous bound
    assert chi2 < df + 6 * math.sqrt(2 * df), chi2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_distribution_unseeded(name: str) -> None:
    params = CONFIGS[name]
    expected = reference_distribution(LOGITS, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **params})
    # the filter must actually mask something for the test to mean anything
    assert (expected == 0).any() == (name != "temperature")
    num = 40_000
    logits = torch.tensor(LOGITS).expand(num, -1)
    out = Sampler(seed=1234)(logits, [make_row(**params) for _ in range(num)])
    assert_matches(out.token_ids, expected)


def test_distribution_mixed_batch() -> None:
    """All configs interleaved in one batch: per-row parameters must not leak across rows."""
    names = list(CONFIGS)
    num = 25_000 * len(names)
    rows = [make_row(**CONFIGS[names[i % len(names)]]) for i in range(num)]
    logits = torch.tensor(LOGITS).expand(num, -1)
    tokens = Sampler(seed=99)(logits, rows).token_ids
    for j, name in enumerate(names):
        full = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **CONFIGS[name]}
        assert_matches(tokens[j :: len(names)], reference_distribution(LOGITS, **full))


def test_distribution_seeded_rows() -> None:
    """Per-row generators, reused over steps, sample the same distribution."""
    params = CONFIGS["combined"]
    num_rows, steps = 400, 50
    rows = [make_row(seeded(5000 + i), **params) for i in range(num_rows)]
    logits = torch.tensor(LOGITS).expand(num_rows, -1)
    sampler = Sampler()
    tokens = [t for _ in range(steps) for t in sampler(logits, rows).token_ids]
    full = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **params}
    assert_matches(tokens, reference_distribution(LOGITS, **full))


# --- penalties ----------------------------------------------------------------------------

PENALTY_LOGITS = [
    [3.0, -1.0, 0.5, 2.0, -0.5, 1.0],
    [0.0, 2.5, 2.4, 1.0, -3.0, -3.0],
    [1.0, 0.9, 0.0, 0.0, -1.0, 0.2],
    [1.0, 0.9, 0.0, 0.0, -1.0, 0.2],
    [0.5, 0.4, 0.0, -2.0, -1.0, 0.2],
]


def penalty_rows() -> list[SamplingRow]:
    return [
        # repetition over prompt+output, presence and frequency over output only
        make_row(
            prompt=[0, 1, 1],
            output=[2, 2, 4, 2],
            temperature=0.0,
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
        # frequency only: the prompt's token 1 does not count, the output's two do
        make_row(prompt=[1, 1, 1], output=[1, 1], temperature=0.0, frequency_penalty=0.1),
        # presence only, and the token is only in the prompt: no effect
        make_row(prompt=[0], output=[], temperature=0.0, presence_penalty=0.5),
        # no penalties at all
        make_row(prompt=[0, 1], output=[0, 0], temperature=0.0),
        # negative presence penalty rewards a repeated token
        make_row(prompt=[0], output=[3, 5], temperature=0.0, presence_penalty=-0.4),
    ]


def test_apply_penalties_matches_hand_computed_values() -> None:
    logits = torch.tensor(PENALTY_LOGITS)
    before = logits.clone()
    expected = torch.tensor(
        [
            # 0: 3/2; 1: -1*2; 2: 0.5/2 - 3*0.25 - 0.5; 3: untouched; 4: -0.5*2 - 0.25 - 0.5
            [1.5, -2.0, -1.0, 2.0, -1.75, 1.0],
            [0.0, 2.3, 2.4, 1.0, -3.0, -3.0],  # 1: 2.5 - 2*0.1
            [1.0, 0.9, 0.0, 0.0, -1.0, 0.2],
            [1.0, 0.9, 0.0, 0.0, -1.0, 0.2],
            [0.5, 0.4, 0.0, -1.6, -1.0, 0.6],  # 3: -2 + 0.4; 5: 0.2 + 0.4
        ]
    )
    penalized = apply_penalties(logits, penalty_rows())
    assert penalized.dtype == torch.float32
    torch.testing.assert_close(penalized, expected)
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_penalties_flip_greedy_choice() -> None:
    logits = torch.tensor(PENALTY_LOGITS)
    unpenalized = [make_row(prompt=r.prompt_token_ids, temperature=0.0) for r in penalty_rows()]
    assert Sampler()(logits, unpenalized).token_ids == [0, 1, 0, 0, 0]
    assert Sampler()(logits, penalty_rows()).token_ids == [3, 2, 0, 0, 5]


def test_no_penalties_is_a_no_op() -> None:
    logits = torch.randn(3, 10, generator=seeded(4))
    rows = [make_row(prompt=[1, 2], output=[3, 3]) for _ in range(3)]
    assert torch.equal(apply_penalties(logits, rows), logits)


# --- logit bias ---------------------------------------------------------------------------


def test_logit_bias_adds_to_each_rows_own_tokens_after_penalties() -> None:
    logits = torch.tensor(PENALTY_LOGITS)
    before = logits.clone()
    rows = penalty_rows()
    biases = [{3: -100.0}, None, {0: -2.5, 5: 1.0}, {}, {4: 100, 1: 0.25}]
    biased = [
        make_row(None, r.prompt_token_ids, r.output_token_ids, **{**vars_of(r), "logit_bias": b})
        for r, b in zip(rows, biases, strict=True)
    ]
    expected = apply_penalties(logits, rows)
    for i, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[i, token] += value
    torch.testing.assert_close(process_logits(logits, biased), expected)
    assert torch.equal(logits, before)  # the raw logits (logprobs') are not modified
    # rows 0 and 2 move off their penalized argmax (3 -> 0, 0 -> 5); row 4 is forced to 4
    assert Sampler()(logits, rows).token_ids == [3, 2, 0, 0, 5]
    assert Sampler()(logits, biased).token_ids == [0, 2, 5, 0, 4]


def vars_of(row: SamplingRow) -> dict:
    p = row.params
    return dict(
        temperature=p.temperature, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
    )  # fmt: skip


def test_logit_bias_forces_and_bans_tokens_in_a_sampled_batch() -> None:
    """+100 makes a token certain and -100 impossible whatever the temperature; the greedy
    pick made already (a CUDA graph's) is not taken for a biased batch."""
    logits = torch.randn(6, 50, generator=seeded(7))
    top = logits.argmax(dim=-1)
    rows = [
        make_row(seeded(1), temperature=1.5, logit_bias={17: 100.0}),
        make_row(seeded(2), temperature=0.0, logit_bias={int(top[1]): -100.0}),
        make_row(seeded(3), temperature=1.0, top_k=1, logit_bias={int(top[2]): -100}),
        make_row(seeded(4), temperature=0.0),
        make_row(seeded(5), temperature=2.0, logit_bias={t: -100.0 for t in range(1, 50)}),
        make_row(seeded(6), temperature=0.0, logit_bias={9: 100.0}),
    ]
    out = Sampler().sample(logits, rows, greedy_ids=top).resolve()
    second = logits.topk(2).indices[:, 1].tolist()
    assert out.token_ids == [17, second[1], second[2], int(top[3]), 0, 9]
    greedy = [make_row(temperature=0.0, logit_bias={3: 100.0})] * 6
    assert Sampler().sample(logits, greedy, greedy_ids=top).resolve().token_ids == [3] * 6


def test_banned_tokens_are_never_picked() -> None:
    """A row's banned tokens (min_tokens' EOS and stop tokens) lose to anything, a +100 bias
    on one of them included; the graph's greedy pick is not taken for such a batch."""
    logits = torch.randn(3, 40, generator=seeded(9))
    top = logits.argmax(dim=-1)
    second = logits.topk(2).indices[:, 1]
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), None, [], [], banned=(int(top[0]),)),
        SamplingRow(
            SamplingParams(temperature=0.0, logit_bias={int(top[1]): 100.0}),
            None,
            [],
            [],
            banned=(int(top[1]), 39),
        ),  # fmt: skip
        SamplingRow(
            SamplingParams(temperature=1.0, top_k=1), seeded(1), [], [], banned=(int(top[2]),)
        ),
    ]
    out = Sampler().sample(logits, rows, greedy_ids=top).resolve()
    assert out.token_ids == second.tolist()
    assert torch.isinf(process_logits(logits, rows)[0, top[0]])


def test_logit_bias_is_validated() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={5: 1}).processes_logits
    for bad in ({5: 101.0}, {-1: 1.0}, {5: float("nan")}, {"5": 1.0}, {True: 1.0}, [(5, 1.0)]):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    SamplingParams(logit_bias={99: -100}).check_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"token 100 is not in the vocabulary \[0, 100\)"):
        SamplingParams(logit_bias={100: -100, 3: 1}).check_vocab(100)


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_of_chosen_and_top_tokens() -> None:
    logits = torch.randn(5, 32, generator=seeded(6))
    rows = [
        make_row(temperature=0.0, logprobs=3),
        make_row(seeded(1), temperature=0.5, repetition_penalty=1.5, output=[4, 9], logprobs=5),
        make_row(temperature=1.0, logprobs=None),
        make_row(seeded(2), temperature=2.0, top_k=20, logprobs=0),
        make_row(temperature=1.0, presence_penalty=2.0, output=[0], logprobs=1),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            continue
        entry, chosen = out.logprobs[i], out.token_ids[i]
        # the chosen token: raw log-softmax value (before penalties/temperature) and its rank
        assert entry[chosen].logprob == pytest.approx(raw[i, chosen].item(), abs=1e-5)
        assert entry[chosen].rank == int((raw[i] > raw[i, chosen]).sum()) + 1
        # the top-n: the n largest, ranked 1..n in order
        n = row.params.logprobs
        top = raw[i].topk(n).indices.tolist() if n else []
        for rank, tok in enumerate(top, start=1):
            assert entry[tok].rank == rank
            assert entry[tok].logprob == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert set(entry) == set(top) | {chosen}
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.logprobs[0][out.token_ids[0]].rank == 1


@pytest.mark.parametrize("vocab_size", [128256, 49152, 1031, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_argmax_with_its_ties(vocab_size, dtype):
    """The two-stage argmax of a few rows picks what torch's argmax picks, the first index
    among equal maxima included (logits drawn from a handful of values: many ties, across
    chunks and within them), and -inf rows."""
    from lantau.sampling.sampler import argmax_rows

    gen = torch.Generator().manual_seed(vocab_size)
    for num_rows in (1, 3, 70):
        logits = torch.randint(0, 4, (num_rows, vocab_size), generator=gen).to(dtype)
        logits[0, : vocab_size // 2] = float("-inf")
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        smooth = torch.randn(num_rows, vocab_size, generator=gen).to(dtype)
        assert torch.equal(argmax_rows(smooth), smooth.argmax(dim=-1))
