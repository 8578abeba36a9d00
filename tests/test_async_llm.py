"""AsyncLLM against a real engine-core process: streaming outputs, abort on early exit, and a
failure in the output path fails requests instead of leaving them hanging."""

from __future__ import annotations

import asyncio

import pytest

from lantau.engine.async_llm import AsyncLLM, EngineDeadError
from lantau.llm import build_engine_config
from lantau.model.loader import load_tokenizer
from lantau.request import SamplingParams


async def started_engine() -> AsyncLLM:
    config, source = build_engine_config(
        "random:tiny", device="cpu", max_model_len=256, num_kv_blocks=64
    )
    engine = AsyncLLM(config, source, load_tokenizer(source))
    await engine.start()
    return engine


async def idle_stats(engine: AsyncLLM, timeout: float = 5.0):
    """The core's report once it holds no request (heartbeats refresh it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            return s
        await asyncio.sleep(0.1)
    raise AssertionError(f"engine not idle: {engine.stats}")


def test_generate_stream_abort_and_failure():
    async def main():
        engine = await started_engine()
        try:
            params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
            outputs, seen = [], []
            async for o in engine.generate("a", {"prompt_token_ids": [5, 6]}, params):
                outputs.append(o)
                seen.append(len(o.outputs[0].token_ids))  # tokens visible at this item
            assert outputs[-1].finished and seen[-1] == 8
            # at most one item per engine step; each is the same, growing RequestOutput, so
            # a reader that falls behind (two steps' items queued) skips nothing: it reads
            # the deltas from the object (two items may then show the same tokens), and the
            # stream ends once it shows `finished`
            assert all(o is outputs[0] for o in outputs)
            assert seen == sorted(seen) and len(seen) <= 8  # never shrinks

            long = SamplingParams(max_tokens=200, ignore_eos=True)
            before = (await idle_stats(engine)).num_generated_tokens
            stream = engine.generate("b", {"prompt_token_ids": [7, 8, 9]}, long)
            await anext(stream)
            await stream.aclose()  # leave after the first token: the core must drop it
            assert "b" not in engine.queues
            assert (await idle_stats(engine)).num_generated_tokens - before < 200

            def broken(outputs, prompt_logprobs=None):
                raise RuntimeError("planted bug")

            engine.processor.process = broken
            with pytest.raises(EngineDeadError, match="planted bug"):
                async for _ in engine.generate("c", {"prompt_token_ids": [1, 2]}, params):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_first_tokens_are_sent_before_running_streams_are_detokenized():
    """In a step's outputs the core lists running requests first; the frontend detokenizes
    and queues a new request's first output, and lets its stream resume (and send its first
    chunk), before it even detokenizes the running streams' outputs. No core: the engine's
    messages are fed to it directly."""
    from types import SimpleNamespace

    from lantau.engine.protocol import CoreOutputs, StepStats
    from lantau.outputs import RequestOutput

    async def main():
        config, source = build_engine_config("random:tiny", device="cpu", max_model_len=256)
        engine = AsyncLLM(config, source, load_tokenizer(source))  # not started

        async def no_core(msg) -> None:
            pass

        engine._send = no_core
        made: dict[str, RequestOutput] = {}
        events: list[str] = []  # "process a b" (a detokenizing pass), "resume a" (a stream)

        def process(outs, prompt_logprobs=None):  # as the processor hands them on: one a request
            ids = [engine.processor.child_to_parent[o.request_id][0] for o in outs]
            events.append("process " + " ".join(ids))
            return [made[i] for i in ids], []

        engine.processor.process = process
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        async def stream(request_id: str) -> None:
            made[request_id] = RequestOutput(request_id, None, [5, 6])
            async for _ in engine.generate(request_id, {"prompt_token_ids": [5, 6]}, params):
                events.append(f"resume {request_id}")

        def child(request_id: str):
            return next(
                c for c, (p, _) in engine.processor.child_to_parent.items() if p == request_id
            )

        async def step(*request_ids: str) -> list[str]:
            events.clear()
            outs = [SimpleNamespace(request_id=child(r)) for r in request_ids]
            await engine._handle_outputs(CoreOutputs(outs, StepStats()))
            for _ in range(3):
                await asyncio.sleep(0)
            return list(events)

        tasks = [asyncio.create_task(stream(r)) for r in ("a", "b")]
        await asyncio.sleep(0)
        assert await step("a") == ["process a", "resume a"]
        # b's first output: detokenized, queued and sent before a's is even detokenized
        assert await step("a", "b") == ["process b", "resume b", "process a", "resume a"]
        assert await step("a", "b") == ["process a b", "resume a", "resume b"]  # as before
        assert engine.awaiting_first == set()
        made["a"].finished = made["b"].finished = True
        await step("a", "b")
        await asyncio.gather(*tasks)
        assert engine.queues == {} and engine.awaiting_first == set()

    asyncio.run(main())
