"""The host's time a step for structured outputs' masks (lantau/structured.py's Grammars.masks):
N requests held to a JSON schema, each a few tokens into its object, the default model's
tokenizer (49,152 tokens), one matcher after another on the engine's thread; against the same
masks on llguidance's thread pool (LLExecutor), the same-run peer.

    .venv/bin/python benchmarks/cpu_structured_masks.py [--requests 1,16,64] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lantau.model.source import load_tokenizer, resolve_model_source
from lantau.structured import Grammars, tokenizer_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="1,16,64")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    tok = load_tokenizer(resolve_model_source("random:tiny"))
    ids = tok.encode(json.dumps({"name": "Alice Smith", "tags": ["x"], "n": 1}))
    grammars = Grammars(lambda: tokenizer_json(tok), len(tok), [tok.eos_token_id])
    grammars.prepare()
    import llguidance

    executor = llguidance.LLExecutor()
    print(f"{'requests':>8} {'masks ms':>9} {'threaded ms':>12}")
    for n in (int(x) for x in args.requests.split(",")):
        names = [f"r{i}" for i in range(n)]
        for i, name in enumerate(names):
            grammars.add(name, {"json": SCHEMA}, ids[: 3 + i % 5])
        grammars.masks(names)  # the matchers' caches warm
        start = time.perf_counter()
        for _ in range(args.reps):
            grammars.masks(names)
        own = (time.perf_counter() - start) / args.reps * 1e3
        words = (len(tok) + 31) // 32
        masks = torch.full((n, words), -1, dtype=torch.int32)
        pairs = [(grammars.matchers[name], row) for row, name in enumerate(names)]
        start = time.perf_counter()
        for _ in range(args.reps):
            executor.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), words * 4, n)
        threaded = (time.perf_counter() - start) / args.reps * 1e3
        print(f"{n:>8} {own:>9.3f} {threaded:>12.3f}")
        for name in names:
            grammars.drop(name)


if __name__ == "__main__":
    main()
