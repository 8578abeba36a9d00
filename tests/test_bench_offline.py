"""`lantau bench offline` end to end on CPU (the GPU runs it through benchmarks/gpu_h200.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lantau.bench.workloads import make_workload


def test_workloads_have_the_specified_shapes():
    w5 = make_workload("W5", 128256)
    assert w5.num_prompts == 256 and w5.max_tokens == 128
    assert all(len(p) == 1024 and p[:512] == w5.prompts[0][:512] for p in w5.prompts)
    w2 = make_workload("W2", 128256)
    assert (w2.num_prompts, len(w2.prompts[0]), w2.max_tokens) == (1, 128, 512)
    w3 = make_workload("W3-2048", 128256, num_prompts=3)
    assert [len(p) for p in w3.prompts] == [2048] * 3 and w3.max_tokens == 128


@pytest.mark.parametrize(
    "engine_flags",
    [
        [],
        ["--no-async-scheduling", "--scheduling-policy", "guaranteed_no_evict"]
        + ["--kv-cache-dtype", "fp8"],
    ],
    ids=["default", "sync+no-evict+fp8-kv"],
)
def test_bench_offline_cli(tmp_path, engine_flags):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "lantau.cli", "bench", "offline", "--model", "random:tiny",
        "--workload", "in:24/out:6", "--num-prompts", "5", "--output", str(out), *engine_flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    ours = result["lantau"]
    assert ours["num_prompts"] == 5 and ours["output_tokens"] == 30
    assert ours["output_tok_s"] > 0 and ours["e2e_p95_s"] >= ours["e2e_p50_s"] > 0
    assert "lantau" in proc.stdout  # the printed table
    assert result["kv_cache_dtype"] == ("fp8" if "fp8" in engine_flags else "auto")
    assert result["kv_tokens"] == 16 * result["kv_blocks"] > 0


def test_engine_sizes_per_workload():
    """W3 rows default to the sizes the H200 runs settled on; given sizes always win."""
    from lantau.bench.offline import engine_sizes

    assert engine_sizes("W3-1000", None, None) == (384, 65536)
    assert engine_sizes("W3-128", 128, None) == (128, 65536)
    assert engine_sizes("W3-2048", None, 8192) == (384, 8192)
    assert engine_sizes("W2", None, None) == (256, None)
    assert engine_sizes("in:24/out:6", 8, 64) == (8, 64)


def test_greedy_agreement_counts_the_leading_tokens_that_agree(tiny_llama_dir):
    """The same-run arms' check: the greedy tokens of one prompt, and how many lead as in the
    reference (all of them against themselves, up to the first change otherwise)."""
    from lantau import LLM
    from lantau.bench.offline import greedy_agreement

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = [5, 17, 42, 99, 3]
    tokens, same = greedy_agreement(llm, prompt, None, n=8)
    assert len(tokens) == 8 and same == 8
    again, same = greedy_agreement(llm, prompt, tokens, n=8)
    assert again == tokens and same == 8
    changed = tokens[:3] + [(t + 1) % 512 for t in tokens[3:]]
    assert greedy_agreement(llm, prompt, changed, n=8)[1] == 3
