"""LoRA adapters (lantau/model/lora.py) against HF transformers with PEFT on the same
adapters: each request of a batch that mixes two adapters and the base model gets its own
model's tokens and logits; an adapter's cached prefixes serve only that adapter."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from lantau import LLM, SamplingParams
from lantau.errors import InvalidRequestError, ModelLoadError
from lantau.model.lora import parse_lora_modules
from tests.conftest import hf_greedy
from tests.test_engine import check_clean, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base_dir, folder, seed: int, **config) -> None:
    """A PEFT LoRA adapter of the tiny model, its B matrices drawn (PEFT starts them at 0)."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def served_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with the default model's tokenizer beside it (texts of ids < 512)."""
    import shutil

    from lantau.model import gguf_loader
    from lantau.model.source import default_model_path

    folder = tmp_path_factory.mktemp("tiny-with-tokenizer")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    gguf_loader.load_gguf_tokenizer(default_model_path()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(tiny_llama_dir, root / "all", 1, r=4, lora_alpha=8, target_modules=ALL)
    save_adapter(tiny_llama_dir, root / "qv", 2, r=8, lora_alpha=4,
                 target_modules=["q_proj", "v_proj"], use_rslora=True)  # fmt: skip
    return {"all": root / "all", "qv": root / "qv"}


def hf_reference(tiny_llama_dir, adapter_dir, prompt, n: int):
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None  # like ignore_eos: always n tokens
    model = base if adapter_dir is None else peft.PeftModel.from_pretrained(base, adapter_dir)
    return hf_greedy(model.eval(), prompt, n)


def test_a_batch_of_two_adapters_and_the_base_model_matches_peft(tiny_llama_dir, adapters):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=128,
        lora_modules=[f"all={adapters['all']}", f"qv={adapters['qv']}"],
    )  # fmt: skip
    prompts = random_prompts(6, seed=11, max_len=40)
    names = ["all", None, "qv", "all", "qv", None]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, lora=name)
        for name in names
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        adapter = None if name is None else adapters[name]
        tokens, logits = hf_reference(tiny_llama_dir, adapter, prompt, 8)
        assert out.outputs[0].token_ids == tokens, name
        # the last token's logprob as HF's last-step logits give it
        last = out.outputs[0].logprobs[-1][tokens[-1]].logprob
        assert last == pytest.approx(torch.log_softmax(logits, -1)[tokens[-1]].item(), abs=1e-4)
    # the adapters change the answers (the test would pass on the base model otherwise)
    base = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )]  # fmt: skip
    assert all(base[i] != outs[i].outputs[0].token_ids for i in (0, 2, 3, 4))
    check_clean(llm)


def test_an_adapters_cached_prefix_serves_only_that_adapter(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              lora_modules=[f"all={adapters['all']}"])  # fmt: skip
    prompt = {"prompt_token_ids": list(range(10, 60))}

    def cached(lora):
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, lora=lora)
        return llm.generate(prompt, params)[0].num_cached_tokens

    assert cached("all") == 0 and cached("all") == 48  # three blocks of its own
    assert cached(None) == 0 and cached(None) == 48  # the base model's are apart
    with pytest.raises(InvalidRequestError, match="'nope' is not a LoRA adapter of this engine"):
        llm.engine.add_request("x", prompt, SamplingParams(lora="nope"))
    check_clean(llm)


def test_lora_modules_specs():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == (("a", "/x"), ("b", "/y"))
    for bad, message in [(["a"], "expected NAME=PATH"), (["a=/x", "a=/y"], "given twice"),
                         (["../a=/x"], "a name of letters")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3', not LORA"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"r": 16}, "A (4, 160) and B (64, 4), expected (16, 160) and (64, 16)"),
    ],
)
def test_adapters_lantau_cannot_apply_are_named_errors(tiny_llama_dir, adapters, tmp_path, change,
                                                       message):  # fmt: skip
    folder = tmp_path / "changed"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(
        (adapters["all"] / "adapter_model.safetensors").read_bytes()
    )
    config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match="lora module 'x'") as e:
        LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=16,
            lora_modules=[f"x={folder}"])  # fmt: skip
    assert message in str(e.value)
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=16,
            lora_modules=[f"x={tmp_path / 'missing'}"])  # fmt: skip


def test_adapters_split_over_two_ranks_give_the_one_rank_tokens(tiny_llama_dir, adapters):
    """Tensor parallel (gloo, two ranks): each rank holds its slices of every adapter (B by
    rows where the projection splits its rows, A by columns where it splits its input) and
    the mixed batch's tokens are the one-rank engine's; the two ranks run the triton
    backend's adapter kernels on their slices, the one rank the torch reference."""
    common = dict(dtype="float32", device="cpu", num_kv_blocks=64,
                  lora_modules=[f"all={adapters['all']}", f"qv={adapters['qv']}"])  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=5, max_len=30)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=name)
              for name in ("all", "qv", None)]  # fmt: skip

    def run(llm) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    split = LLM(str(tiny_llama_dir), tensor_parallel_size=2, attention_backend="triton",
                **common)  # fmt: skip
    tokens = run(split)
    del split
    assert tokens == run(LLM(str(tiny_llama_dir), **common))


def test_served_adapters_by_name(served_dir, adapters, tmp_path, monkeypatch):
    """`lantau serve --lora-modules`: /v1/models lists each adapter with its base model as
    parent; a completion naming an adapter is that adapter's (the offline engine's text with
    it, checked against PEFT above), one naming the base model is the base model's, and an
    unknown name is a 404. /metrics counts each adapter's requests and tokens and names the
    adapters with requests running (vLLM's lora_requests_info)."""
    import httpx
    import openai

    from tests.servers import kserve_greedy_text, lantau_serve

    delay = tmp_path / "delay"  # 10 ms a step: a long request is still running when scraped
    delay.write_text("0.01")
    monkeypatch.setenv("LANTAU_TEST_STEP_DELAY_FILE", str(delay))

    prompt = random_prompts(1, seed=21, max_len=30)[0]
    offline = LLM(str(served_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                  lora_modules=[f"all={adapters['all']}", f"qv={adapters['qv']}"])  # fmt: skip

    def expected(lora) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=lora)
        return offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text

    assert expected("all") != expected(None) != expected("qv")
    flags = ("--dtype", "float32", "--served-model-name", "base", "--enable-lora",
             "--lora-modules", f"all={adapters['all']}", f"qv={adapters['qv']}",
             "--log-requests")  # fmt: skip
    with lantau_serve(str(served_dir), *flags) as (base, proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert listed == {"base": None, "all": "base", "qv": "base"}
        for model, lora in (("all", "all"), ("qv", "qv"), ("base", None)):
            reply = client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            want = expected(lora)
            assert want and reply.model == model and reply.choices[0].text == want, model
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=prompt, max_tokens=2)
        # KServe v2's generate names the adapter as its model too
        text = "1,2,3,4,5,6,7,8"  # its ids are all the tiny model's (< 512)
        ids = offline.engine.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora="qv")
        want = offline.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text
        assert kserve_greedy_text(base, "qv", text, 8) == want

        def lora_info() -> str:
            text = httpx.get(f"{base}/metrics", timeout=30).text
            return next(line for line in text.splitlines()
                        if line.startswith("lantau:lora_requests_info{"))  # fmt: skip

        # usage by adapter: the two completions and the KServe generate above, 8 tokens each
        text = httpx.get(f"{base}/metrics", timeout=30).text

        def usage(metric: str, lora: str) -> float:
            label = f'lora_name="{lora}"'
            return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(f"{metric}{{") and label in line)  # fmt: skip

        assert usage("lantau:lora_requests_total", "all") == 1
        assert usage("lantau:lora_requests_total", "qv") == 2
        assert usage("lantau:lora_generation_tokens_total", "qv") == 16
        assert usage("lantau:lora_prompt_tokens_total", "all") == len(prompt)
        idle = lora_info()
        assert all(label in idle for label in ('max_lora="2"', 'model_name="base"',
                   'running_lora_adapters=""', 'waiting_lora_adapters=""')), idle  # fmt: skip
        body = {"model": "qv", "prompt": prompt, "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # held open: a closed stream is a client gone (an abort)
            next(line for line in lines if line.startswith("data: "))  # running now
            busy = lora_info()
            assert 'running_lora_adapters="qv"' in busy and 'waiting_lora_adapters=""' in busy
    # the request log names each request's adapter (a platform's usage by adapter)
    logged = [json.loads(x) for x in proc.output.splitlines() if x.startswith('{"time"')]
    by_route = [(x["route"], x.get("lora_name")) for x in logged if "e2e_s" in x]
    assert by_route[:4] == [
        ("/v1/completions", "all"),
        ("/v1/completions", "qv"),
        ("/v1/completions", None),
        ("/v2/models/qv/generate", "qv"),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "nofolder"], "lora module 'nofolder': expected NAME=PATH"),
        (["--served-model-name", "a", "--lora-modules", "a=/x"], "the served model's own name"),
        (["--lora-modules", "a=/nonexistent"], "lora module 'a' (/nonexistent): no adapter_config"),
        (["--lora-dir", "/"], "--lora-dir needs a slot beyond the --lora-modules adapters'"),
        (["--lora-dir", "/nonexistent", "--max-loras", "1"], "--lora-dir /nonexistent: not a"),
    ],
)
def test_bad_lora_modules_stop_the_server_with_their_reason(flags, message):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lantau.cli", "serve", "random:tiny", "--device", "cpu",
           "--port", "0", "--grpc-port", "0", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2) and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_graph_steps_with_adapters_match_eager(tiny_llama_dir, adapters):
    """The CUDA graphs' passes (decode and mixed), run on CPU without capture: with adapters
    the graphs' buffers carry each row's adapter slot (-1 for base rows and padding) and a
    step with adapter rows takes the pass that adds the deltas, so a replay gives the eager
    step's logits whatever the batch mixes, and the graphs need no eager fallback; a step of
    the base model alone takes the plain pass (no delta: an adapter server's base traffic
    costs what it does without adapters), whose logits the adapter pass gives too."""
    from lantau.config import KernelConfig
    from lantau.runner.cuda_graph import CudaGraphRunner
    from lantau.runner.mixed_graph import MixedGraphRunner

    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=4,
        max_num_batched_tokens=80, attention_backend="triton",
        kernels=KernelConfig(enable_gemv=False),
        lora_modules=[f"all={adapters['all']}", f"qv={adapters['qv']}"],
    )  # fmt: skip
    runner = llm.engine.core.runner
    decode = CudaGraphRunner(
        runner.config, runner.model, runner.kv_caches, runner.device, runner.token_ids
    )
    mixed = MixedGraphRunner(runner.config, runner.model, runner.kv_caches, runner.device)
    eager_forward, checked = runner._forward_logits, []

    def both(inputs):
        replayed = None
        if decode.can_run(inputs):
            bs, turn = decode.bucket(inputs.num_reqs), 1 - runner._last
            decode.stage(inputs, bs, turn)
            before = runner.token_ids[turn].clone()
            replayed = {
                lora: decode._step(bs, None, turn, lora)[0][: len(inputs.sample_ids)].clone()
                for lora in (False, True)
            }
            runner.token_ids[turn].copy_(before)
            checked.append(("decode", sorted(set(inputs.lora_index.tolist()))))
        elif mixed.can_run(inputs):
            num_tokens = mixed.bucket(len(inputs.input_ids))
            mixed.stage(inputs, num_tokens)
            runner.fill_pending(mixed.input_ids[:num_tokens], inputs)
            replayed = {
                lora: runner._sample_logits(mixed.forward(num_tokens, lora), inputs)
                for lora in (False, True)
            }
            checked.append(("mixed", sorted(set(inputs.lora_index.tolist()))))
        logits = eager_forward(inputs)
        if replayed is not None:
            # the pass the step's graph would be: with the deltas when a row has an adapter
            picked = replayed[inputs.has_adapter_rows]
            torch.testing.assert_close(picked, logits, rtol=1e-4, atol=1e-4)
            if not inputs.has_adapter_rows:  # the adapter pass adds nothing to base rows
                torch.testing.assert_close(replayed[True], logits, rtol=1e-4, atol=1e-4)
        return logits

    runner._forward_logits = both
    prompts = random_prompts(4, seed=9, max_len=40)
    names = ["all", None, "qv", "all"]
    engine = llm.engine
    for i in (0, 1):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, lora=names[i])
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
    for step in range(60):  # the rest arrive while the first ones decode: mixed steps
        if step in (2, 3):
            i = step
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, lora=names[i])
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        engine.step()
        if not engine.has_unfinished_requests:
            break
    # then a request of the base model alone: its steps have no adapter row
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("r4", {"prompt_token_ids": prompts[1]}, params)
    while engine.has_unfinished_requests:
        engine.step()
    kinds = {kind for kind, _ in checked}
    assert kinds == {"decode", "mixed"}, checked
    # batches that mixed adapters with the base model ran through the graphs' passes, and
    # so did steps of the base model alone
    assert any(-1 in slots and len(slots) > 1 for _, slots in checked), checked
    assert any(slots == [-1] for _, slots in checked), checked
    check_clean(llm)


def test_adapters_load_and_unload_at_runtime(tiny_llama_dir, adapters):
    """Free slots (max_loras) take adapters while the engine runs: one loaded at runtime
    gives the tokens of an engine started with it; one in use, unknown, too large a rank or
    without a free slot is refused and nothing changes; an adapter loaded again under an
    unloaded one's name never meets that one's cached blocks."""
    common = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(10, 60))}

    def run(llm, lora):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=lora)
        out = llm.generate(prompt, params)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    want_all = run(LLM(str(tiny_llama_dir), lora_modules=[f"all={adapters['all']}"], **common),
                   "all")[0]  # fmt: skip
    want_qv = run(LLM(str(tiny_llama_dir), lora_modules=[f"qv={adapters['qv']}"], **common),
                  "qv")[0]  # fmt: skip
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=8, **common)
    core = llm.engine.core
    with pytest.raises(InvalidRequestError, match="'x' is not a LoRA adapter"):
        run(llm, "x")
    core.load_adapter("x", str(adapters["all"]))
    assert run(llm, "x") == (want_all, 0)
    assert run(llm, "x") == (want_all, 48)  # its own blocks serve it
    with pytest.raises(ValueError, match="all 1 slots are taken"):
        core.load_adapter("y", str(adapters["qv"]))
    llm.engine.add_request("busy", prompt, SamplingParams(max_tokens=2, lora="x"))
    with pytest.raises(ValueError, match="'x' is in use by 1 request"):
        core.unload_adapter("x")
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    core.unload_adapter("x")
    with pytest.raises(ValueError, match="'x' is not loaded"):
        core.unload_adapter("x")
    core.load_adapter("x", str(adapters["qv"]))  # another adapter under the same name
    assert run(llm, "x") == (want_qv, 0)  # the old x's cached blocks are not its
    check_clean(llm)
    small = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=4, **common)
    with pytest.raises(ValueError, match="rank 8 is over the engine's max_lora_rank 4"):
        small.engine.core.load_adapter("q", str(adapters["qv"]))
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        small.engine.core.load_adapter("q", "/nonexistent")
    with pytest.raises(ValueError, match="no LoRA adapter slots"):
        LLM(str(tiny_llama_dir), **common).engine.core.load_adapter("q", str(adapters["qv"]))


def test_runtime_adapters_on_two_ranks(tiny_llama_dir, adapters):
    """An adapter loaded at runtime reaches every rank (its slices in each): the split
    engine's tokens with it are the one-rank engine's."""
    common = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_loras=2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, seed=8, max_len=30)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=name)
              for name in ("all", None)]  # fmt: skip

    def run(llm) -> list[list[int]]:
        llm.engine.core.load_adapter("all", str(adapters["all"]))
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    split = LLM(str(tiny_llama_dir), tensor_parallel_size=2, attention_backend="triton",
                **common)  # fmt: skip
    tokens = run(split)
    del split
    assert tokens == run(LLM(str(tiny_llama_dir), **common))


def test_served_runtime_adapter_updates(served_dir, adapters):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on a real server: a loaded
    adapter is listed and answers under its name (the offline engine's text with it), a bad
    one is a 400 with the reason, an unloaded one is gone (404); a server without
    --allow-runtime-lora-updating refuses both routes."""
    import httpx
    import openai

    from tests.servers import lantau_serve

    prompt = random_prompts(1, seed=4, max_len=20)[0]
    offline = LLM(str(served_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                  lora_modules=[f"qv={adapters['qv']}"])  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora="qv")
    want = offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text
    flags = ("--dtype", "float32", "--served-model-name", "base", "--max-loras", "1",
             "--max-lora-rank", "8", "--allow-runtime-lora-updating")  # fmt: skip
    with lantau_serve(str(served_dir), *flags) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def post(route, **body):
            return httpx.post(f"{base}/v1/{route}_lora_adapter", json=body, timeout=60)

        def complete(model):
            return client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=6,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )

        reply = post("load", lora_name="qv", lora_path=str(adapters["qv"]))
        assert reply.status_code == 200, reply.text
        assert reply.text == "Success: LoRA adapter 'qv' added successfully."
        assert {m.id for m in client.models.list().data} == {"base", "qv"}
        assert complete("qv").choices[0].text == want
        for body, status, message in [
            (dict(lora_name="more", lora_path=str(adapters["all"])), 400, "all 1 slots are taken"),
            (dict(lora_name="qv", lora_path=str(adapters["all"])), 400, "'qv' is served already"),
            (dict(lora_name="base", lora_path=str(adapters["all"])), 400, "served already"),
            (dict(lora_name="z"), 400, "lora_path"),
        ]:  # fmt: skip
            reply = post("load", **body)
            assert reply.status_code == status and message in reply.text, reply.text
        assert post("unload", lora_name="nope").status_code == 404
        reply = post("unload", lora_name="qv")
        assert reply.status_code == 200 and "removed successfully" in reply.text
        with pytest.raises(openai.NotFoundError):
            complete("qv")
        reply = post("load", lora_name="bad", lora_path="/nonexistent")
        assert reply.status_code == 400 and "no adapter_config.json" in reply.text
    with lantau_serve(str(served_dir), "--max-loras", "1") as (base, _):
        reply = httpx.post(
            f"{base}/v1/load_lora_adapter",
            timeout=60,
            json={"lora_name": "qv", "lora_path": str(adapters["qv"])},
        )
        assert reply.status_code == 404 and "--allow-runtime-lora-updating" in reply.text


_COMPILE_LORA_SM90 = """
from sass_loops import compile_sm90, disassemble
from lantau.kernels import lora
shrink = {"x_ptr": "*bf16", "a_ptr": "*bf16", "index_ptr": "*i64", "part_ptr": "*fp32"}
expand = {"part_ptr": "*fp32", "b_ptr": "*bf16", "index_ptr": "*i64", "y_ptr": "*bf16"}
common = dict(UPCAST=False, DOT_PRECISION="tf32", USE_PDL=True)
for block_t, block_w in ((16, 32), (64, 64)):  # decode batches, prompt chunks
    kernel = compile_sm90(lora._shrink_kernel, shrink, dict(RANK=48, BLOCK_T=block_t,
        BLOCK_W=block_w, BLOCK_K=128, **common), 4, 3, ints=("K", "k_per_split"))
    sass = disassemble(kernel)
    print("shrink", block_t, "cp.async" in kernel.asm["ptx"], "HMMA" in sass or "HGMMA" in sass)
    kernel = compile_sm90(lora._expand_kernel, expand, dict(SPLIT=4 if block_t == 16 else 1,
        BLOCK_T=block_t, BLOCK_N=128, BLOCK_W=64, **common), 4, 3)
    sass = disassemble(kernel)
    print("expand", block_t, "HMMA" in sass or "HGMMA" in sass)
"""


def test_lora_kernels_compile_for_hopper():
    """lantau/kernels/lora.py's launches as the model makes them (bf16, PDL) compile to sm90
    with Triton's own ptxas, no GPU needed: what catches a construct the interpreter runs but
    the compiler rejects; the shrink's K loop streams its tiles through cp.async, and both
    products run on the tensor cores (HMMA, or Hopper's HGMMA for 64-token tiles, in the
    SASS, from Triton's own nvdisasm)."""
    from tests.compiled import run_compiled

    assert run_compiled(_COMPILE_LORA_SM90).split("\n")[:4] == [
        "shrink 16 True True",
        "expand 16 True",
        "shrink 64 True True",
        "expand 64 True",
    ]


def test_triton_kernels_give_the_reference_tokens(tiny_llama_dir, adapters, monkeypatch):
    """The triton backend (lantau/kernels/lora.py's launches, through the interpreter, for its
    4-row decode steps; the masked GEMMs for the prompts' step, over lora_kernel_max_tokens)
    gives a batch mixing two adapters and the base model the torch backend's greedy tokens and
    logprobs (the reference's masked GEMMs)."""
    from lantau.kernels import lora as kernels
    from lantau.model import ops

    steps = {"kernels": set(), "masked": set()}
    original_kernels, original_masked = kernels.add_lora, ops.add_lora

    def spying_kernels(y, x, *args, **kwargs):
        steps["kernels"].add(x.shape[0])
        return original_kernels(y, x, *args, **kwargs)

    def spying_masked(y, x, *args, **kwargs):
        steps["masked"].add(x.shape[0])
        return original_masked(y, x, *args, **kwargs)

    monkeypatch.setattr(kernels, "add_lora", spying_kernels)
    monkeypatch.setattr(ops, "add_lora", spying_masked)
    prompts = random_prompts(4, seed=5, max_len=30)
    names = ["all", None, "qv", "all"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, lora=name)
        for name in names
    ]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
            attention_backend=backend, enforce_eager=True,
            lora_modules=[f"all={adapters['all']}", f"qv={adapters['qv']}"],
        )  # fmt: skip
        outs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        check_clean(llm)
    # the triton engine: its decode steps through the kernels, its prompt step masked
    assert steps["kernels"] == {4}, steps
    assert max(steps["masked"]) == sum(map(len, prompts)) > 32, steps
    for ref, out in zip(outs["torch"], outs["triton"], strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b, t in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs,
                           ref.outputs[0].token_ids, strict=True):  # fmt: skip
            assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4)


@pytest.mark.usefixtures("interpreter_fp8_cast")
def test_adapters_over_fp8_layers_read_the_fused_ops_outputs(tiny_llama_dir, adapters):
    """fp8 weights with KernelConfig.fuse_fp8_quant: the norms write only the quantized rows
    their fp8 projection reads, except where an adapter's delta reads the output too (then
    stored as well): a batch with an adapter, then the base model alone, gives the unfused
    engine's tokens and logprobs."""
    from lantau.config import KernelConfig

    prompts = random_prompts(2, seed=9, max_len=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, lora=name)
        for name, n in (("all", 3), (None, 6))
    ]
    results = {}
    for fuse in (False, True):
        llm = LLM(
            str(tiny_llama_dir), device="cpu", dtype="fp8", num_kv_blocks=64,
            attention_backend="triton", enforce_eager=True,
            kernels=KernelConfig(fuse_fp8_quant=fuse, enable_gemv=False),
            lora_modules=[f"all={adapters['all']}"],
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[fuse] = [
            [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
            for o in (out.outputs[0] for out in outputs)
        ]
        check_clean(llm)
    assert results[True] == results[False]


def test_warm_up_runs_adapter_rows_and_leaves_nothing_behind(tiny_llama_dir, adapters,
                                                             monkeypatch):  # fmt: skip
    """With adapters served, the warm-up's requests run through one of them too (so the
    adapter kernels' eager variants compile before serving), and leave nothing behind: no
    block, no cached prefix of the adapter's, its slot still served, its tokens as before."""
    from lantau.engine.warmup import warm_up
    from lantau.model import ops

    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=512,
              max_model_len=512, max_num_batched_tokens=64,
              lora_modules=[f"all={adapters['all']}"])  # fmt: skip
    prompt = {"prompt_token_ids": random_prompts(1, seed=3, max_len=30)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora="all")
    before = llm.generate(prompt, params)[0].outputs[0].token_ids
    llm.reset_prefix_cache()
    calls = []
    reference = ops.add_lora
    monkeypatch.setattr(ops, "add_lora", lambda *a: calls.append(1) or reference(*a))
    assert warm_up(llm.engine.core) > 0
    assert calls  # adapter rows ran
    check_clean(llm)
    assert not llm.engine.core.kv_cache.pool.hash_to_block_id
    assert llm.engine.core.runner.lora_slots == {"all": 0}
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == before


def test_lora_dir_serves_adapters_by_folder_loaded_on_first_request(
    served_dir, adapters, tmp_path, monkeypatch
):
    """`--lora-dir DIR --max-loras 2`: a request naming a folder of DIR loads that adapter
    into a free slot on its first request (its answers the adapter's, as the offline engine
    gives them), into the least recently asked idle one's slot once both are taken; names
    that are not folders of DIR (or not names) are 404s, an adapter over the slots' rank a
    400; with every slot's adapter busy, a third is a 429 and nothing is lost; many first
    requests at once load it once."""
    import asyncio
    import shutil

    import httpx

    from tests.servers import lantau_serve

    root = tmp_path / "loras"
    shutil.copytree(adapters["all"], root / "all")
    shutil.copytree(adapters["qv"], root / "qv")
    save_adapter(served_dir, root / "third", 3, r=4, lora_alpha=8,
                 target_modules=["o_proj", "down_proj"])  # fmt: skip
    save_adapter(served_dir, root / "big", 4, r=16, target_modules=["q_proj"])  # over rank 8
    prompt = random_prompts(1, seed=23, max_len=30)[0]
    offline = LLM(str(served_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                  lora_modules=[f"{n}={root / n}" for n in ("all", "qv", "third")])  # fmt: skip

    def expected(lora) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=lora)
        return offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text

    delay = tmp_path / "delay"  # 10 ms a step: held streams stay in flight
    delay.write_text("0.01")
    monkeypatch.setenv("LANTAU_TEST_STEP_DELAY_FILE", str(delay))
    flags = ("--dtype", "float32", "--served-model-name", "base", "--lora-dir", str(root),
             "--max-loras", "2", "--max-lora-rank", "8")  # fmt: skip
    with lantau_serve(str(served_dir), *flags) as (base, _):

        def ask(model: str) -> httpx.Response:
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            return httpx.post(f"{base}/v1/completions", json=body, timeout=60)

        def served() -> set[str]:
            return {m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]}

        assert served() == {"base"}
        for model, now in (("all", {"all"}), ("qv", {"all", "qv"}), ("third", {"qv", "third"}),
                           ("all", {"third", "all"})):  # fmt: skip
            reply = ask(model)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected(model), model
            assert served() == {"base", *now}, model
        for name in ("nope", "..", "a/../all"):
            assert ask(name).status_code == 404, name
        refused = ask("big")  # its rank is over the slots': a 400 with the reason
        assert refused.status_code == 400 and "big" in refused.text, refused.text
        assert "big" not in served()

        async def busy_then_third() -> tuple[int, str, list[int]]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                held = []
                for model in ("third", "all"):  # a long stream on each slot's adapter
                    body = {"model": model, "prompt": prompt, "max_tokens": 300, "stream": True,
                            "ignore_eos": True}  # fmt: skip
                    stream = client.stream("POST", "/v1/completions", json=body)
                    response = await stream.__aenter__()
                    lines = response.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass
                    held.append((stream, lines))
                refused = await client.post("/v1/completions", json={
                    "model": "qv", "prompt": prompt, "max_tokens": 2})  # fmt: skip
                ends = []
                for stream, lines in held:  # both finish whole
                    async for line in lines:
                        if line.startswith("data: ") and '"finish_reason":"length"' in line:
                            ends.append(1)
                    await stream.__aexit__(None, None, None)
                return refused.status_code, refused.text, ends

        status, text, ends = asyncio.run(busy_then_third())
        assert status == 429 and "all 2 LoRA adapter slots" in text, text
        assert ends == [1, 1]

        async def at_once() -> list[int]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                body = {"model": "qv", "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
                        "ignore_eos": True}  # fmt: skip
                replies = await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(6))
                )
                return [r.json()["choices"][0]["text"] for r in replies]

        assert asyncio.run(at_once()) == [expected("qv")] * 6
        assert served() == {"base", "qv", "all"}  # the least recently asked (third) went
