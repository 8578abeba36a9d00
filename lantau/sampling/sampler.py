"""Batched token sampling: penalties, logit bias, greedy, temperature, min-p/top-k/top-p, logprobs.

vLLM's semantics. Every step is vectorized over the rows of one [num_rows, vocab_size] logits
tensor; per-row parameters travel as small [num_rows] tensors through pinned memory. Nothing
in `sample()` waits for the device: the chosen token ids (and logprobs, when asked for) are
copied to pinned host memory behind an event, and `PendingSample.resolve()` waits for that
event alone, so the next step's forward pass may already be queued behind the sampling.

Sampling uses the exponential race: argmax(probs / q) with q ~ Exponential(1) i.i.d. picks
token i with probability probs[i]. Each seeded row draws its own q from its own generator, so
its tokens depend only on that generator and its logits, never on the rest of the batch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from lantau.request import Logprob, SamplingParams

__all__ = [
    "Logprob",
    "Sampler",
    "SamplerOutput",
    "PendingSample",
    "SamplingRow",
    "apply_min_p",
    "apply_logit_bias",
    "apply_penalties",
    "process_logits",
    "uses_penalties",
    "apply_top_k_top_p",
    "compute_logprobs",
]


@dataclass
class SamplingRow:
    """One row of the logits to sample from."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request seeded generator; None: the shared one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned: tuple[int, ...] = ()  # tokens it may not pick now (EOS and stop tokens, min_tokens)
    # structured outputs: the tokens its grammar allows next, a bit each ([words] int32, host)
    allowed: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # per row: None if params.logprobs is None, else the chosen token's and the top-n's
    logprobs: list[dict[int, Logprob] | None]


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list, numpy array or tensor on `device` without a stream sync: CUDA copies go
    through pinned memory (a pageable copy would wait for all queued work)."""
    host = torch.as_tensor(values, dtype=dtype)  # numpy arrays are not copied
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to (pinned) host memory; valid once the stream reaches
    the copy (PendingSample's event)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@functools.cache
def _argmax_chunk(vocab_size: int) -> int:
    """A divisor of vocab_size in [512, 4096] (the largest), or 0 if none."""
    return next((c for c in range(4096, 511, -1) if vocab_size % c == 0), 0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (the first index among equal maxima), for a few rows in two stages:
    the argmax of each chunk of the row, then of the chunks' maxima. One program per row, as
    the plain reduction runs it, leaves most SMs idle on one 128k-token row; chunks spread it
    over the SMs."""
    num_rows, vocab_size = logits.shape
    chunk = _argmax_chunk(vocab_size)
    if num_rows >= 64 or not chunk:
        return logits.argmax(dim=-1)
    chunks = logits.reshape(num_rows, vocab_size // chunk, chunk)
    within = chunks.argmax(dim=-1)  # [num_rows, num_chunks]
    maxima = chunks.gather(-1, within[..., None]).squeeze(-1)  # [num_rows, num_chunks]
    best = maxima.argmax(dim=-1, keepdim=True)  # [num_rows, 1]: the first chunk holding it
    return (best * chunk + within.gather(-1, best)).squeeze(-1)


def uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _token_counts(
    token_lists: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each row's list: [num_rows, vocab_size] float32."""
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    if not any(token_lists):
        return counts.view(num_rows, vocab_size)
    # NOTE: one flat host list per step; fine while outputs are short, a persistent device
    # token buffer would avoid re-uploading the prompts every step. The row of each token is
    # built on the host: repeat_interleave on the device would sync to size its output.
    flat = list(itertools.chain.from_iterable(token_lists))
    rows_host = list(itertools.chain.from_iterable([i] * len(t) for i, t in enumerate(token_lists)))
    tokens = to_device(flat, device, torch.int64)
    rows = to_device(rows_host, device, torch.int64)
    # [total_tokens] flat offsets into the [num_rows * vocab_size] view
    counts.scatter_add_(0, rows * vocab_size + tokens, torch.ones_like(tokens, dtype=counts.dtype))
    return counts.view(num_rows, vocab_size)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties; float32 result, the input is not modified.

    Repetition penalty covers tokens seen in the prompt or the output (positive logits divided,
    others multiplied, as HF/vLLM); presence and frequency penalties cover output tokens only.
    Returns `logits` as float32 untouched (possibly the same tensor) when no row has a penalty.
    """
    logits = logits.float()
    if not any(uses_penalties(r.params) for r in rows):
        return logits
    num_rows, vocab_size = logits.shape
    device = logits.device
    # Rows without penalties contribute no tokens, so their counts stay zero and their
    # penalties (1, 0, 0) leave them as they are.
    output_counts = _token_counts(
        [r.output_token_ids if uses_penalties(r.params) else [] for r in rows],
        num_rows,
        vocab_size,
        device,
    )
    prompt_counts = _token_counts(
        [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows],
        num_rows,
        vocab_size,
        device,
    )
    f32 = torch.float32
    rep = to_device([r.params.repetition_penalty for r in rows], device, f32)[:, None]
    presence = to_device([r.params.presence_penalty for r in rows], device, f32)[:, None]
    freq = to_device([r.params.frequency_penalty for r in rows], device, f32)[:, None]

    seen = (prompt_counts > 0) | (output_counts > 0)  # [num_rows, vocab_size]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)  # [num_rows, vocab_size]
    logits = torch.where(seen, repeated, logits)
    logits = logits - freq * output_counts - presence * (output_counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (a new tensor; `logits` as it is when no
    row has one)."""
    if not any(r.params.logit_bias for r in rows):
        return logits
    biases = [r.params.logit_bias or {} for r in rows]
    values = [b for bias in biases for b in bias.values()]
    index = _row_token_index(logits.device, biases)  # a bias's keys are its tokens
    return logits.index_put(index, to_device(values, logits.device, logits.dtype), accumulate=True)


def ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's banned tokens at -inf (a new tensor; `logits` as it is when none is)."""
    if not any(r.banned for r in rows):
        return logits
    index = _row_token_index(logits.device, [r.banned for r in rows])
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def _row_token_index(device: torch.device, tokens_by_row) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) on the device indexing each row's tokens, row by row."""
    row_ids = [i for i, tokens in enumerate(tokens_by_row) for _ in tokens]
    token_ids = [t for tokens in tokens_by_row for t in tokens]
    return to_device(row_ids, device, torch.int64), to_device(token_ids, device, torch.int64)


def allow_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row with a grammar's bitmask (`allowed`): every token it does not allow at -inf
    (a new tensor; `logits` as it is when no row has one)."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not constrained:
        return logits
    device, vocab_size = logits.device, logits.shape[-1]
    words = torch.stack([rows[i].allowed for i in constrained]).to(device)  # [k, words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]; bit 31: the sign, shifted
    allowed = bits.reshape(len(constrained), -1)[:, :vocab_size].bool()  # [k, <= vocab_size]
    if allowed.shape[1] < vocab_size:  # tokens past the grammar's vocabulary: never
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    index = to_device(constrained, device, torch.int64)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return out


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits each row samples from: penalties, logit bias, banned tokens, a grammar's
    allowed tokens; float32, the input is not modified (logprobs are the raw logits')."""
    processed = apply_logit_bias(apply_penalties(logits, rows), rows)
    return allow_tokens(ban_tokens(processed, rows), rows)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose prob is below min_p × the row's top prob; min_p: [num_rows]."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed, and
    # min_p = 0 gives -inf, which masks nothing.
    max_logit = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    threshold = max_logit + torch.log(min_p)[:, None]  # [num_rows, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask all but the top_k tokens, then all but the top_p nucleus of what remains.

    top_k: [num_rows] int64, 0 or -1 for off; top_p: [num_rows] float32, 1.0 for off. One
    descending sort serves both; the most likely token is always kept.
    """
    num_rows, vocab_size = logits.shape
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
    positions = torch.arange(vocab_size, device=logits.device)[None, :]  # [1, vocab_size]

    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [num_rows]
    sorted_logits = sorted_logits.masked_fill(positions >= k[:, None], float("-inf"))

    # Cumulative prob of the tokens strictly before each one: a token is kept while the set
    # above it has not yet reached top_p, which also always keeps position 0.
    sorted_probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab_size]
    prob_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p = 1 rows are excluded explicitly: rounding in the cumsum could reach 1.0 early.
    drop = (prob_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def logprob_tensors(
    raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> tuple[torch.Tensor, ...] | None:
    """Device half of the logprobs: for the rows asking for them, (chosen token, its logprob,
    its rank, top-n logprobs, top-n ids) under the raw (unprocessed) logits. None if no row
    asks. raw_logits: [num_rows, vocab_size]; token_ids: [num_rows] int64 on the same device.
    """
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return None
    vocab_size = raw_logits.shape[-1]
    idx = to_device(wanted, raw_logits.device, torch.int64)
    logprobs = raw_logits[idx].float().log_softmax(dim=-1)  # [num_wanted, vocab_size]
    chosen_ids = token_ids[idx]  # [num_wanted]
    chosen = logprobs.gather(-1, chosen_ids[:, None]).squeeze(-1)  # [num_wanted]
    # rank = 1 + number of strictly more likely tokens
    chosen_rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1  # [num_wanted]
    max_n = min(max(rows[i].params.logprobs for i in wanted), vocab_size)
    top_vals, top_ids = logprobs.topk(max_n, dim=-1)  # [num_wanted, max_n], descending
    return chosen_ids, chosen, chosen_rank, top_vals, top_ids


def logprob_dicts(
    tensors: tuple[torch.Tensor, ...] | None, rows: list[SamplingRow]
) -> list[dict[int, Logprob] | None]:
    """Host half: logprob_tensors' result (on the host) as one dict per row."""
    result: list[dict[int, Logprob] | None] = [None] * len(rows)
    if tensors is None:
        return result
    token_l, chosen_l, rank_l, top_vals_l, top_ids_l = (t.tolist() for t in tensors)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    for j, i in enumerate(wanted):
        entry = {token_l[j]: Logprob(chosen_l[j], rank_l[j])}
        for pos in range(min(rows[i].params.logprobs, len(top_ids_l[j]))):
            # the chosen token keeps its own entry should it also be among the top-n
            entry.setdefault(top_ids_l[j][pos], Logprob(top_vals_l[j][pos], pos + 1))
        result[i] = entry
    return result


def compute_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> list[dict[int, Logprob] | None]:
    """Logprobs of the chosen tokens and each row's top-n, under the raw logits (syncs)."""
    tensors = logprob_tensors(raw_logits, rows, token_ids)
    return logprob_dicts(None if tensors is None else [t.cpu() for t in tensors], rows)


@dataclass
class PendingSample:
    """Tokens chosen on the device, on their way to the host."""

    token_ids: torch.Tensor  # [num_rows] int64 on the device: the next step's inputs read it
    rows: list[SamplingRow]
    host_token_ids: torch.Tensor  # host copy, valid once `event` has completed
    host_logprobs: tuple[torch.Tensor, ...] | None = None
    event: torch.cuda.Event | None = field(default=None, repr=False)
    waited: bool = False  # resolve() found the copies not done (the host waited for the step)

    def copied(self) -> bool:
        """Whether its copies have completed already (False on the CPU: no copies)."""
        return self.event is not None and self.event.query()

    def resolve(self) -> SamplerOutput:
        """Wait for this sample's copies only (not for work queued after it)."""
        if self.event is not None:
            self.waited = not self.event.query()
            self.event.synchronize()
        return SamplerOutput(
            token_ids=self.host_token_ids.tolist(),
            logprobs=logprob_dicts(self.host_logprobs, self.rows),
        )


def greedy_pick(
    logits: torch.Tensor, out: torch.Tensor | None = None, use_pdl: bool = True
) -> torch.Tensor:
    """Each row's argmax, [num_rows] int64 (written into `out` if given, and returned): on
    CUDA the one-launch Triton kernel (lantau/kernels/argmax.py), else argmax_rows."""
    if logits.device.type == "cuda":
        from lantau.kernels.argmax import argmax

        return argmax(logits, out, use_pdl)
    ids = argmax_rows(logits)
    return ids if out is None else out.copy_(ids)


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for semantics."""

    def __init__(
        self, seed: int = 0, device: torch.device | str = "cpu", use_pdl: bool = True
    ) -> None:
        self.device = torch.device(device)
        # draws the exponential noise of rows without their own generator
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.use_pdl = use_pdl  # the argmax kernel's (KernelConfig.enable_pdl)
        # the stream that copies the chosen ids (and logprobs) to the host, once the current
        # stream has computed them (None: the current stream, before whatever is queued next);
        # see PendingSample
        self.copy_stream: torch.cuda.Stream | None = None

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy_pick(logits, use_pdl=self.use_pdl)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).resolve()

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], greedy_ids: torch.Tensor | None = None
    ) -> PendingSample:
        """Queue the sampling of one token per row; nothing here waits for the device.
        greedy_ids: each row's argmax of these logits if already picked (the CUDA graph's);
        an all-greedy batch without penalties takes it as its token_ids, the same tensor."""
        # logits: [num_rows, vocab_size], any float dtype
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per row"
        device = logits.device
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled and not any(
            r.params.processes_logits or r.banned or r.allowed is not None for r in rows
        ):
            # argmax of the logits as they are: a float32 copy orders (and ties) the same
            token_ids = self._argmax(logits) if greedy_ids is None else greedy_ids
            return self._pending(logits, rows, token_ids)
        processed = process_logits(logits, rows)  # [num_rows, vocab_size] float32
        if not sampled:
            token_ids = self._argmax(processed)  # [num_rows]
        elif not greedy:
            token_ids = self._sample(processed, rows)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
            g_idx = to_device(greedy, device, torch.int64)
            token_ids[g_idx] = processed[g_idx].argmax(dim=-1)
            s_idx = to_device(sampled, device, torch.int64)
            token_ids[s_idx] = self._sample(processed[s_idx], [rows[i] for i in sampled])
        return self._pending(logits, rows, token_ids)

    def _pending(self, logits: torch.Tensor, rows: list[SamplingRow], token_ids) -> PendingSample:
        """The chosen ids (and the logprobs asked for) on their way to pinned host memory."""
        logprobs = logprob_tensors(logits, rows, token_ids)
        if logits.device.type != "cuda":
            return PendingSample(token_ids, rows, token_ids, logprobs)
        tensors = (token_ids, *(logprobs or ()))
        stream = self.copy_stream or torch.cuda.current_stream()
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            for t in tensors:  # the caching allocator's: not reused before the copy
                t.record_stream(self.copy_stream)
        with torch.cuda.stream(stream):
            host = [to_host(t) for t in tensors]
            event = torch.cuda.Event()
            event.record()
        return PendingSample(token_ids, rows, host[0], tuple(host[1:]) if logprobs else None, event)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, filters, then the exponential race; logits: [num_sampled, vocab_size]."""
        device = logits.device
        temperature = to_device([r.params.temperature for r in rows], device, torch.float32)
        logits = logits / temperature[:, None]  # [num_sampled, vocab_size]

        # Each filter is skipped when no row uses it: the sort in top-k/top-p is the costly one.
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = to_device([r.params.min_p for r in rows], device, torch.float32)
            logits = apply_min_p(logits, min_p)
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            top_k = to_device([r.params.top_k for r in rows], device, torch.int64)
            top_p = to_device([r.params.top_p for r in rows], device, torch.float32)
            logits = apply_top_k_top_p(logits, top_k, top_p)

        probs = logits.softmax(dim=-1)  # [num_sampled, vocab_size]
        q = self._exponential_noise(rows, probs.shape[-1], device)  # [num_sampled, vocab_size]
        return (probs / q).argmax(dim=-1)  # [num_sampled]

    def _exponential_noise(
        self, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """Exponential(1) noise, [len(rows), vocab_size]: one [vocab_size] draw per seeded row
        from its own generator, one batched draw from the shared generator for the rest."""
        q = torch.empty(len(rows), vocab_size, device=device)
        unseeded = []
        for i, row in enumerate(rows):
            if row.generator is None:
                unseeded.append(i)
            else:
                q[i].exponential_(generator=row.generator)
        if unseeded:
            shared = torch.empty(len(unseeded), vocab_size, device=device)
            shared.exponential_(generator=self.generator)
            q[to_device(unseeded, device, torch.int64)] = shared
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)
