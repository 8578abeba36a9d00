"""How far a model (fp8 weights, bf16) strays from a reference one (fp32, bf16): every
position's logits over a fixed text (relative error, perplexity) and greedy continuations of
fixed prompts (agreement). tests/test_fp8_accuracy.py asserts bounds on these on CPU;
benchmarks/gpu_fp8.py prints them on the GPU; docs/fp8.md states the numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lantau.model.forward_context import AttentionMetadata, ForwardContext
from lantau.model.llama import LlamaForCausalLM
from lantau.request import SamplingParams


@torch.no_grad()
def sequence_logits(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16):
    """Every position's logits of one sequence in one prefill: [T, vocab] fp32. Its own KV
    cache, so the engine's is untouched."""
    device = model.lm_head.weight.device
    c = model.config
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    kv_caches = [
        torch.zeros(
            (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim),
            dtype=model.lm_head.weight.dtype,
            device=device,
        )
        for _ in range(c.num_hidden_layers)
    ]

    def i32(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=i32([0, num_tokens]),
        seq_lens=i32([num_tokens]),
        block_tables=i32([list(range(num_blocks))]),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    positions = torch.arange(num_tokens, device=device)
    ctx = ForwardContext(meta, kv_caches, positions)
    hidden = model(torch.tensor(token_ids, device=device), ctx)  # [T, hidden]
    return model.compute_logits(hidden).float()  # [T, vocab]


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token. logits: [T, vocab]."""
    targets = torch.tensor(token_ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets)
    return math.exp(nll.item())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), in fp32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def greedy_tokens(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt's first num_tokens greedy tokens through the engine (EOS ignored)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def leading_agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The mean share of each continuation that leads as the reference's does (1.0: all
    identical): a continuation that diverges once is free to differ after."""
    shares = []
    for ours, ref in zip(tokens, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), len(ref))
        shares.append(same / len(ref))
    return sum(shares) / len(shares)


@dataclass
class Accuracy:
    """One model against the reference, on the same text and prompts."""

    logits_rel_err: float  # over every position of the text
    top1_agreement: float  # share of the text's positions with the reference's argmax
    perplexity: float
    reference_perplexity: float
    greedy_agreement: float  # leading_agreement of the prompts' continuations
    num_identical: int  # continuations identical to the reference's
    num_prompts: int

    def line(self, name: str) -> str:
        return (
            f"{name}: logits rel. err {self.logits_rel_err:.4f}, top-1 {self.top1_agreement:.3f}, "
            f"perplexity {self.perplexity:.3f} (reference {self.reference_perplexity:.3f}), "
            f"greedy agreement {self.greedy_agreement:.3f} "
            f"({self.num_identical}/{self.num_prompts} identical)"
        )


def compare(
    llm, ref_logits: torch.Tensor, ref_tokens: list[list[int]], text_ids: list[int],
    prompts: list[list[int]], num_tokens: int,
) -> Accuracy:  # fmt: skip
    """llm (an `LLM`) against reference logits of text_ids and reference continuations."""
    logits = sequence_logits(llm.engine.core.runner.model, text_ids)
    tokens = greedy_tokens(llm, prompts, num_tokens)
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    return Accuracy(
        logits_rel_err=rel_err(logits, ref_logits),
        top1_agreement=top1,
        perplexity=perplexity(logits, text_ids),
        reference_perplexity=perplexity(ref_logits, text_ids),
        greedy_agreement=leading_agreement(tokens, ref_tokens),
        num_identical=sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)),
        num_prompts=len(prompts),
    )
