"""The "before" of the reference deployment's before/after table: HF transformers behind the
same HTTP API as `lantau serve` (OpenAI `/v1/completions`, streamed or not, `/v1/models`,
`/health`; `/stats`: the static batches' sizes), so that `lantau bench serve` drives both alike.

It serves as a plain HF deployment does: requests wait in a queue and run in static batches of
up to --max-batch, taken as they come (or within --batch-wait-ms of a batch's first) (left-padded,
one HF forward a token for the whole batch, with its KV cache),
a batch running until its last request is done; new requests wait for the next batch. Greedy or
temperature sampling; `ignore_eos`; each token streamed as it is made.

    PYTHONPATH=. python3 benchmarks/hf_serve.py --model random:llama3-8b --port 8001 \\
        [--max-batch 16] [--device cuda] [--dtype bfloat16]
    lantau bench serve --url http://127.0.0.1:8001 --workload W1 --rate 16 --out before/
    lantau bench serve --url http://127.0.0.1:8000 --workload W1 --rate 16 --out after/ \\
        --before before/

--model: an HF folder, or random:NAME (lantau's random shapes, e.g. random:llama3-8b: random
weights, the tokenizer lantau would use); --tokenizer: another folder's or random:NAME's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import torch


@dataclass
class Job:
    """One request: its prompt ids, limits, and where its tokens go (an asyncio queue of the
    server's loop; None ends the stream)."""

    ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_made: int = 0  # the batcher's count

    def emit(self, token: int | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, token)


def load_tokenizer(spec: str):
    """random:NAME: the tokenizer lantau would use; else an HF folder's."""
    if spec.startswith("random:"):
        from lantau.engine.args import build_engine_config
        from lantau.model.loader import load_tokenizer as lantau_tokenizer

        return lantau_tokenizer(build_engine_config(spec, device="cpu")[1])
    import transformers

    return transformers.AutoTokenizer.from_pretrained(spec)


def load(model: str, device: str, dtype: torch.dtype):
    """(HF model, eos ids) for an HF folder or random:NAME."""
    import transformers

    if model.startswith("random:"):
        from lantau.bench.offline import hf_config_of
        from lantau.engine.args import build_engine_config

        config, _ = build_engine_config(model, device="cpu")
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(hf_config_of(config.model_config)).to(dtype)
        return hf.eval(), set(config.model_config.eos_token_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    eos = hf.generation_config.eos_token_id
    return hf, set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


class StaticBatcher:
    """A thread that runs the queued jobs in static batches."""

    def __init__(
        self, model, eos: set[int], max_batch: int, device: str, batch_wait_s: float = 0.0
    ) -> None:
        self.model, self.eos, self.max_batch, self.device = model, eos, max_batch, device
        self.batch_wait_s = batch_wait_s  # after a batch's first request, wait for more
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.batch_sizes: list[int] = []  # each batch run, in order (GET /stats)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            until = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    break
            self.batch_sizes.append(len(batch))
            try:
                with torch.inference_mode():
                    self._generate(batch)
            except Exception as e:  # every stream of the batch ends with the error
                for job in batch:
                    job.emit(e)

    def _generate(self, batch: list[Job]) -> None:
        n, width = len(batch), max(len(job.ids) for job in batch)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for row, job in enumerate(batch):  # left-padded
            ids[row, width - len(job.ids) :] = torch.tensor(job.ids)
            mask[row, width - len(job.ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        done = [False] * n
        temperature = torch.tensor([job.temperature for job in batch], device=self.device)
        for _ in range(max(job.max_tokens for job in batch)):
            tokens = pick(out.logits[:, -1].float(), temperature).tolist()
            for row, job in enumerate(batch):
                if done[row]:
                    continue
                job.num_made += 1
                job.emit(tokens[row])
                if job.num_made == job.max_tokens or (
                    not job.ignore_eos and tokens[row] in self.eos
                ):
                    done[row] = True
                    job.emit(None)
            if all(done):
                return
            mask = torch.cat((mask, mask.new_ones(n, 1)), dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=torch.tensor(tokens, device=self.device)[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )


def pick(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Each row's next token: argmax where its temperature is 0, else sampled."""
    greedy = logits.argmax(-1)
    if not bool((temperature > 0).any()):
        return greedy
    probs = torch.softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
    sampled = torch.multinomial(probs, 1)[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


def make_app(batcher: StaticBatcher, tokenizer, model_name: str, vocab_size: int):
    from aiohttp import web

    from lantau.engine.detokenizer import IncrementalDetokenizer
    from lantau.request import SamplingParams

    # special tokens spelled, as tokenizer.decode does; ids past the tokenizer's (a random
    # model's larger vocabulary) spelled as lantau does: id mod the tokenizer's size
    text_params = SamplingParams(skip_special_tokens=False)
    fold_ids_at = len(tokenizer) if vocab_size > len(tokenizer) else None

    def error(status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "invalid_request_error"}}
        return web.json_response(body, status=status)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"batch_sizes": batcher.batch_sizes})

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model_name, "object": "model"}]}
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
            if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
                raise ValueError(f"prompt: token ids in [0, {vocab_size}) expected")
            max_tokens = int(body.get("max_tokens", 16))
            if max_tokens < 1:
                raise ValueError("max_tokens must be at least 1")
            temperature = float(body.get("temperature", 1.0))
        except (KeyError, ValueError, TypeError) as e:
            return error(400, f"{type(e).__name__}: {e}")
        loop = asyncio.get_running_loop()
        job = Job(ids, max_tokens, bool(body.get("ignore_eos")), temperature, asyncio.Queue(), loop)
        batcher.jobs.put(job)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # the text as lantau's frontend grows it (a character's bytes held back until whole)
        detok = IncrementalDetokenizer(tokenizer, text_params, ids, fold_ids_at)

        made: list[int] = []  # as they arrived here

        async def deltas():
            """Each token's new text, as the tokens arrive from the batcher."""
            while (token := await job.out.get()) is not None:
                if isinstance(token, Exception):
                    raise token
                made.append(token)
                before = len(detok.text)
                detok.add_token(token)
                yield detok.text[before:]

        def event(choices: list[dict], **more) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": choices, **more}  # fmt: skip

        def choice(text: str, finished: bool = True) -> dict:
            finish = ("length" if len(made) == max_tokens else "stop") if finished else None
            return {"index": 0, "text": text, "finish_reason": finish}

        def usage() -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": len(made),
                    "total_tokens": len(ids) + len(made)}  # fmt: skip

        def sse(data: dict) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        if not body.get("stream"):
            try:
                async for _ in deltas():
                    pass
            except Exception as e:
                return error(500, str(e))
            # the whole text at once, a last unfinished character's bytes included
            text = tokenizer.decode([t % fold_ids_at if fold_ids_at else t for t in made])
            return web.json_response(event([choice(text)], usage=usage()))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            async for delta in deltas():
                if delta:
                    await response.write(sse(event([choice(delta, finished=False)])))
        except Exception as e:
            await response.write(sse({"error": {"message": str(e), "type": "server_error"}}))
            return response
        await response.write(sse(event([choice("")])))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(sse(event([], usage=usage())))
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application(client_max_size=64 << 20)
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.get("/stats", stats),
            web.post("/v1/completions", completions),
        ]
    )
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF folder, or random:NAME")
    p.add_argument("--tokenizer", default=None, help="an HF folder or random:NAME (the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch", type=int, default=16, help="requests a static batch takes")
    p.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="after a batch's first request, how long to wait for more")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    from aiohttp import web

    model, eos = load(args.model, args.device, getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    batcher = StaticBatcher(model, eos, args.max_batch, args.device, args.batch_wait_ms / 1000)
    app = make_app(batcher, tokenizer, args.model, model.config.vocab_size)
    print(f"HF transformers serving {args.model} on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
