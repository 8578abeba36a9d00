"""Where W2's new allocator segments come from, on the lent GPU.

The CLI's W2 run reports a few new caching-allocator segments during the timed run
(`new_segments_during_run`, 2-3), and its ms/token sits 3-10 us above the same engine's later
runs in one process (benchmarks/gpu_decode_tail.py). Here: the CLI's engine (max_num_seqs 256,
max_model_len 640), W2 three times in a row, the allocator's history recorded through the
first, and the stack of every segment allocated during it.

Run zl (runs/2026-12-03zl-w2_segments.log, a fast-class machine): the 3 segments are 2 MiB
small-pool ones, allocated by the eager prefill's embedding and attention outputs, and cost
nothing measurable: the three runs took 3.755 / 3.755 / 3.756 ms/token (the first recording
the allocator's history). The CLI's W2 on that machine right after: 3.757 (runs/zm).

    PYTHONPATH=. python3 benchmarks/gpu_w2_segments.py
"""

from __future__ import annotations

import torch

from lantau import LLM
from lantau.bench.offline import _num_segments, run_lantau
from lantau.bench.workloads import make_workload


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    device = torch.device("cuda")
    w2 = make_workload("W2", 128256)
    llm = LLM("random:llama3-8b", max_model_len=640, max_num_seqs=256)
    rows = []
    for i in range(3):
        if i == 0:
            torch.cuda.memory._record_memory_history(max_entries=200000)
        before = _num_segments(device)
        stats = run_lantau(llm, w2).summary()
        new = _num_segments(device) - before
        ms = stats["ms_per_token"]
        rows.append(f"| W2 run {i + 1} | {ms:.3f} ms/token | {new} new segments |")
        print(rows[-1], flush=True)
        if i == 0:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            for trace in snapshot["device_traces"]:
                for event in trace:
                    if event["action"] != "segment_alloc":
                        continue
                    print(f"segment_alloc {event['size'] / 2**20:.1f} MiB", flush=True)
                    for frame in event.get("frames", [])[:25]:
                        name = frame.get("filename", "")
                        if "lantau" in name or "torch/nn" in name or "bench" in name:
                            print(f"    {name}:{frame.get('line')} {frame.get('name')}")
    print("\n| what | figure | segments |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
