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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lantau")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(p)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=256)
    p.set_defaults(func=chat)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
