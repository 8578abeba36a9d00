"""The `lantau` command: `chat` (a model in the terminal), `serve`, `bench offline`."""

from __future__ import annotations

import argparse
import sys

from lantau.request import SamplingParams


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scheduling-policy",
        default="max_utilization",
        choices=["max_utilization", "guaranteed_no_evict"],
        help="guaranteed_no_evict: admit only what can finish without preemption",
    )
    p.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="run steps one at a time instead of preparing step N+1 while step N runs",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or random:NAME")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)


def chat(args: argparse.Namespace) -> int:
    from lantau.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    conversation: list[dict] = []
    print(f"lantau chat on {llm.config.model} ({llm.config.device}). Empty line or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        conversation.append({"role": "user", "content": line})
        ids = llm.encode_chat(conversation)
        engine = llm.engine
        engine.add_request("chat", {"prompt_token_ids": ids}, params)
        printed = 0
        reply = ""
        while engine.has_unfinished_requests:
            for output in engine.step():
                reply = output.outputs[0].text
                sys.stdout.write(reply[printed:])
                sys.stdout.flush()
                printed = len(reply)
        print()
        conversation.append({"role": "assistant", "content": reply})
    return 0


def serve(args: argparse.Namespace) -> int:
    import asyncio

    from lantau.server.app import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        served_model_name=args.served_model_name or args.model or "SmolLM2-135M-Instruct",
        api_keys=tuple(args.api_key or ()),
        max_pending_requests=args.max_pending_requests,
        max_pending_tokens=args.max_pending_tokens,
        drain_timeout_s=args.drain_timeout,
        live_max_silence_s=args.liveness_timeout,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
    )
    engine_args = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
    )
    if args.num_kv_blocks:
        engine_args["num_kv_blocks"] = args.num_kv_blocks
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(serve(engine_args, config))


def bench(args: argparse.Namespace) -> int:
    import json

    from lantau.bench.offline import bench_offline, print_report

    result = bench_offline(args)
    print_report(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lantau")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(p)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=256)
    p.set_defaults(func=chat)

    p = sub.add_parser("serve", help="OpenAI and KServe v2 (HTTP, gRPC) server")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001, help="0: no gRPC server")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", action="append", help="repeat for several keys")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    _add_scheduling_args(p)
    p.add_argument("--max-pending-requests", type=int, default=1024, help="then 429")
    p.add_argument("--max-pending-tokens", type=int, default=1 << 20, help="then 429")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument(
        "--liveness-timeout", type=float, default=30.0, help="seconds of engine silence (hung)"
    )
    p.add_argument("--max-n", type=int, default=128, help="samples a request may ask (n)")
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="top logprobs a token may ask (OpenAI's limits, 5 and 20, hold below it)",
    )
    p.set_defaults(func=serve)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="mode", required=True)
    p = b.add_parser("offline", help="the in-process engine on a standard workload")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument(
        "--workload", default="W2", help="W2 | W5 | W3-1000 | W3-128 | W3-2048 | in:N/out:M"
    )
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--peer", action="append", choices=["hf", "hf-static"], help="HF generate too")
    p.add_argument("--peer-prompts", type=int, default=None, help="prompts the peer runs")
    p.add_argument("--max-num-seqs", type=int, default=None, help="W3: 384, else 256")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="W3: 65536, else the engine's"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    _add_scheduling_args(p)
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
