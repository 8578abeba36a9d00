"""The engine's flags as vLLM names them on `lantau serve` (and `chat`, `bench offline`), and
an engine's share of a GPU (runner/memory.py): two engines of 0.45 share one card."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from lantau.cli import make_parser, serve_engine_args
from lantau.engine.args import build_engine_config
from lantau.runner.memory import MemoryBaseline, check_share_free, kv_cache_budget
from tests.servers import lantau_serve

GIB = 1 << 30


def engine_config(*flags: str):
    args = make_parser().parse_args(["serve", "random:tiny", "--device", "cpu", *flags])
    engine_args = serve_engine_args(args)
    return build_engine_config(engine_args.pop("model"), **engine_args)[0]


def test_serve_flags_reach_the_engine_config():
    default = engine_config()
    assert default.cache.gpu_memory_utilization == 0.90 and default.seed == 0
    assert default.cache.enable_prefix_caching and default.scheduler.enable_chunked_prefill
    assert not default.enforce_eager and default.scheduler.max_num_batched_tokens == 16384
    config = engine_config(
        "--gpu-memory-utilization", "0.45", "--seed", "7", "--enforce-eager",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--max-model-len", "300",
    )  # fmt: skip
    assert config.cache.gpu_memory_utilization == 0.45 and config.seed == 7
    assert config.enforce_eager and not config.cache.enable_prefix_caching
    # without chunked prefill a step must hold a whole prompt: the budget is max_model_len
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 300
    for command in ("chat", "bench offline"):
        parsed = make_parser().parse_args(
            [*command.split(), "--seed", "3", "--no-enable-prefix-caching"]
        )
        assert parsed.seed == 3 and parsed.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], 2, "gpu_memory_utilization must be in (0, 1]"),
        (["--max-model-len", "300000"], 2, "max_model_len: 300000 exceeds the model's"),
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64"], 2,
         "max_num_batched_tokens must be >= max_model_len without chunked prefill"),
        (["--num-kv-blocks", "1"], 1,
         "engine core failed to start: ValueError: the KV cache holds 1 blocks"),
    ],
)  # fmt: skip
def test_bad_engine_flags_are_one_line_errors(flags, code, message):
    """A bad flag or model stops `lantau serve` with the reason and no traceback: exit 2
    before anything starts, 1 when the engine core refuses at its start."""
    cmd = [sys.executable, "-m", "lantau.cli", "serve", "random:tiny", "--device", "cpu",
           "--port", "0", "--grpc-port", "0", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def _sampled(base: str, prompt: str) -> dict:
    reply = httpx.post(
        f"{base}/v1/completions",
        json={"model": "random:tiny", "prompt": prompt, "max_tokens": 12, "temperature": 1.0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"text": body["choices"][0]["text"], "usage": body["usage"]}


def test_kernels_from_a_dict_as_json_gives_them():
    """LLM(kernels={...}) (benchmarks pass engine arguments as JSON): lists become the tuples
    the frozen KernelConfig holds, an enum by its value, an unknown field a named error."""
    from lantau.config import AttnMerge, KernelConfig

    config, _ = build_engine_config(
        "random:tiny", device="cpu",
        kernels={"fp8_tensorwise_rows": [128, 768], "attn_small_tile": [64, 2, 2],
                 "attn_merge": "unrolled", "gemv_tiles": [[[6144, 4096], [8, 512, 4, 3]]]},
    )  # fmt: skip
    kernels = config.kernels
    assert kernels.fp8_tensorwise_rows == (128, 768) and kernels.attn_small_tile == (64, 2, 2)
    assert kernels.attn_merge is AttnMerge.UNROLLED
    assert kernels.gemv_tiles == (((6144, 4096), (8, 512, 4, 3)),)
    assert hash(kernels)  # frozen, hashable: as a KernelConfig built in Python
    assert build_engine_config("random:tiny", device="cpu")[0].kernels == KernelConfig()
    with pytest.raises(ValueError, match="kernels: unknown field.s. attn_tile"):
        build_engine_config("random:tiny", device="cpu", kernels={"attn_tile": [1, 2, 3]})


def test_a_served_engine_runs_as_its_flags_say():
    """Three real servers: with --no-enable-prefix-caching a repeated prompt finds nothing
    cached (the default server finds it), and an unseeded sampled request draws from the
    server's --seed: the same seed, the same text; another seed, another."""
    prompt = "Parcel 4471 left the Shenzhen depot on Monday and clears customs soon. " * 4
    flags = ("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager")
    with (
        lantau_serve("random:tiny", "--seed", "7", *flags) as (off, _),
        lantau_serve("random:tiny", "--seed", "7") as (on, _),
        lantau_serve("random:tiny", "--seed", "8") as (other, _),
    ):
        first = [_sampled(base, prompt) for base in (off, on, other)]
        assert first[0]["text"] == first[1]["text"] != first[2]["text"]
        again_off, again_on = _sampled(off, prompt), _sampled(on, prompt)
        assert again_off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again_on["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


# --- an engine's share of the card ------------------------------------------------------


def _budget(baseline: MemoryBaseline, *, free, reserved, allocated, peak, share=0.9, total=80):
    return kv_cache_budget(
        baseline, total=total * GIB, free=int(free * GIB), reserved=int(reserved * GIB),
        allocated=int(allocated * GIB), peak=int(peak * GIB), utilization=share,
    ) / GIB  # fmt: skip


def test_a_lone_engine_gets_its_share_less_its_weights_and_peak():
    """80 GiB card, 0.5 GiB context at start; then 16 GiB of weights, a 4 GiB step peak on
    top and 0.3 GiB of cuBLAS workspace outside torch: 72 - 16 - 4 - 0.3."""
    start = MemoryBaseline(used=int(0.5 * GIB), reserved=0, allocated=0)
    budget = _budget(start, free=80 - 0.5 - 16 - 0.3, reserved=16, allocated=16, peak=20)
    assert budget == pytest.approx(72 - 16 - 4 - 0.3)


def test_two_engines_of_045_share_one_card():
    """The second engine starts beside the first (which holds its 36 GiB): its share is free,
    and its cache gets the same as the first's, the card's total staying under 0.9 of it. The
    share taken from all the card holds (no baseline) would leave it nothing."""
    first_start = MemoryBaseline(used=int(0.5 * GIB), reserved=0, allocated=0)
    first = _budget(first_start, free=80 - 0.5 - 8, reserved=8, allocated=8, peak=10, share=0.45)
    held_by_first = 0.5 + 8 + first
    check_share_free(int((80 - held_by_first) * GIB), 80 * GIB, 0.45, "cuda:0")
    second_start = MemoryBaseline(used=int((held_by_first + 0.5) * GIB), reserved=0, allocated=0)
    free = 80 - held_by_first - 0.5 - 8
    second = _budget(second_start, free=free, reserved=8, allocated=8, peak=10, share=0.45)
    assert second == pytest.approx(first) and first == pytest.approx(36 - 10)
    assert held_by_first + 0.5 + 8 + second <= 0.9 * 80 + 1
    assert _budget(MemoryBaseline(0, 0, 0), free=free, reserved=8, allocated=8, peak=10,
                   share=0.45) < 0  # fmt: skip


def test_a_second_engine_in_one_process_counts_only_its_own():
    """torch's counters are per process: an engine started beside another in the same
    process (LLM twice) subtracts what the first had allocated at its start."""
    first_holds = 30.5  # its weights and cache, all in torch's allocator
    start = MemoryBaseline(
        used=int((first_holds + 0.5) * GIB), reserved=int(first_holds * GIB),
        allocated=int(first_holds * GIB),
    )  # fmt: skip
    budget = _budget(
        start, free=80 - 0.5 - first_holds - 8, reserved=first_holds + 8,
        allocated=first_holds + 8, peak=first_holds + 10, share=0.45,
    )  # fmt: skip
    assert budget == pytest.approx(36 - 10)


def test_what_another_process_takes_meanwhile_shrinks_the_cache():
    """Another process took 50 GiB after this engine started: the card cannot say whose that
    is, so it counts against this engine's share, and the card is never over-committed."""
    start = MemoryBaseline(used=int(0.5 * GIB), reserved=0, allocated=0)
    free = 80 - 0.5 - 16 - 50
    budget = _budget(start, free=free, reserved=16, allocated=16, peak=20)
    assert budget == pytest.approx(72 - 50 - 20)
    assert budget + 4 <= free  # the cache and the step's activations fit what is free


def test_a_share_that_is_not_free_fails_before_the_weights():
    with pytest.raises(ValueError, match="out of memory") as e:
        check_share_free(30 * GIB, 80 * GIB, 0.9, "cuda:0")
    assert "asks for 72.0 GiB of cuda:0's 80.0 GiB, but only 30.0 GiB are free" in str(e.value)
    assert "--gpu-memory-utilization to 0.37 or less" in str(e.value)
    check_share_free(30 * GIB, 80 * GIB, 0.37, "cuda:0")
    assert MemoryBaseline.take("cpu", 0.9) is None
