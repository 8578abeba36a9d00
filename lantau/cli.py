"""`lantau chat`: talk to a model in the terminal (the serving issue adds `lantau serve`)."""

from __future__ import annotations

import argparse
import sys

from lantau.request import SamplingParams


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

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="mode", required=True)
    p = b.add_parser("offline", help="the in-process engine on a standard workload")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument(
        "--workload", default="W2", help="W2 | W5 | W3-1000 | W3-128 | W3-2048 | in:N/out:M"
    )
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--peer", action="append", choices=["hf", "hf-static"], help="HF generate too")
    p.add_argument("--peer-prompts", type=int, default=None, help="prompts the peer runs")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
