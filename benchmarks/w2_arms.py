"""What the W2 same-run benchmarks share (gpu_decode_tail, gpu_down_preload, gpu_down_proj,
gpu_w2_knobs): their engine (start), an arm (a setting of it) timed in the batch-1 decode
graph, W2 through the arms in turn, and the closing JSON and table.

Each script keeps `res` (what goes to its JSON) and `table` (its closing table's rows); the
functions here add to both and print each row as it comes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from lantau import LLM
from lantau.bench.offline import batch1_graph, greedy_agreement, replay_ms, run_lantau
from lantau.bench.workloads import Workload, make_workload

OUT = os.environ.get("OUT", ".")


def start() -> tuple[LLM, Workload, dict, list[str]]:
    """The card printed; the engine the scripts time (random:llama3-8b, batch 1 to 8), W2, and
    an empty `res` (the card in it) and `table`."""
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    llm = LLM("random:llama3-8b", max_model_len=1152, max_num_seqs=8)
    return llm, make_workload("W2", 128256), {"card": torch.cuda.get_device_name()}, []


def row(table: list[str], text: str) -> None:
    table.append(text)
    print(text, flush=True)


def graph_arm(
    llm, w2: Workload, label: str, reference: list[int] | None, res: dict, table: list[str],
    keys: int = 384,
) -> tuple[list[int], float]:  # fmt: skip
    """The engine's batch-1 decode graph at `keys` keys (captured under the arm already set):
    min of 3 x 50 replays, and the arm's first 32 greedy tokens of W2's first prompt against
    `reference`'s. Returns (those tokens, the graph's ms)."""
    tokens, same = greedy_agreement(llm, w2.prompts[0], reference)
    graph = batch1_graph(llm.engine.core.runner.graphs, keys, llm.config.cache.block_size)
    ms = min(replay_ms(graph, 50) for _ in range(3))
    res.setdefault("graph", []).append({"arm": label, "graph_ms": ms, "same": same})
    row(table, f"| decode graph bs1, {keys} keys, {label} | {ms:.4f} ms | {same}/32 tokens |")
    return tokens, ms


def w2_arms(llm, w2: Workload, arms: list, set_arm: Callable, res: dict, table: list[str]):
    """W2 under each arm in turn (set_arm(arm) first; an arm's label is arm[0])."""
    for arm in arms:
        set_arm(arm)
        stats = run_lantau(llm, w2).summary()
        res.setdefault("w2", []).append({"arm": arm[0], **stats})
        row(
            table,
            f"| W2, {arm[0]} | {stats['ms_per_token']:.3f} ms/token | GPU util "
            f"{stats['gpu_util_pct']}% |",
        )


def finish(name: str, res: dict, table: list[str]) -> None:
    """res to $OUT/<name>.json, then the table."""
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| what | figure | comparison |")
    print("\n".join(table))
