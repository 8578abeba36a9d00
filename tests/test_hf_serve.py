"""benchmarks/hf_serve.py, the before/after table's "before" (HF transformers behind the same
HTTP API): a real server process on loopback, its greedy tokens against HF `generate` (alone and
in a left-padded static batch, through the official openai client), and `lantau bench serve`'s
run and report against it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import hf_greedy
from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_server(tiny_llama_dir):
    port = free_port()
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "hf_serve.py"), "--model", str(tiny_llama_dir),
        "--tokenizer", "random:tiny", "--port", str(port), "--device", "cpu", "--dtype",
        "float32", "--max-batch", "4", "--batch-wait-ms", "500",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except Exception:
        proc.kill()
        raise
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """HF `generate`, greedy, one prompt at a time, EOS ignored (as the server's ignore_eos)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    return lambda prompt, n: hf_greedy(model, prompt, n)[0]


def test_greedy_tokens_match_hf_generate_alone_and_batched(hf_server, reference):
    """Prompts of different lengths at once (one static, left-padded batch): each stream's
    text is its own prompt's HF greedy tokens, decoded; a request alone and unstreamed too."""
    import openai

    from lantau.engine.args import build_engine_config
    from lantau.model.loader import load_tokenizer

    tokenizer = load_tokenizer(build_engine_config("random:tiny", device="cpu")[1])
    client = openai.OpenAI(base_url=hf_server + "/v1", api_key="none")
    prompts = [[5, 17, 300, 41, 9], [7, 8], [100, 200, 300, 400, 11, 12, 13, 14, 15], [3]]

    def stream(prompt: list[int]) -> str:
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(stream, prompts))
    with urllib.request.urlopen(hf_server + "/stats") as resp:
        assert json.load(resp)["batch_sizes"][-1] == 4  # one batch, left-padded
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == tokenizer.decode(reference(prompt, 6)), prompt
    alone = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert alone.choices[0].text == tokenizer.decode(reference(prompts[0], 4))
    assert alone.usage.completion_tokens == 4 and alone.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="tiny", prompt=[10**6], max_tokens=2)


def test_bench_serve_runs_against_it_and_reports_before_after(hf_server, tmp_path, capsys):
    """`lantau bench serve` against the HF server (the "before") and again with --before:
    every request completes with its tokens, and the report has the before/after table."""
    from lantau import cli

    def serve(out: Path, *extra: str) -> dict:
        argv = [
            "bench", "serve", "--url", hf_server, "--workload", "random:12/5",
            "--num-requests", "8", "--rate", "inf", "--vocab-size", "512", "--out", str(out),
            *extra,
        ]  # fmt: skip
        assert cli.main(argv) == 0
        return json.loads((out / "results.json").read_text())

    before = serve(tmp_path / "before")
    assert before["summary"]["num_completed"] == 8 and before["summary"]["errors"] == {}
    assert before["summary"]["num_output_tokens"] == 8 * 5
    serve(tmp_path / "after", "--before", str(tmp_path / "before"))
    assert "Before / after" in (tmp_path / "after" / "report.md").read_text()
    capsys.readouterr()
