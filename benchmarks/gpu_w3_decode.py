"""Where a W3-1000 decode step's time goes, in the engine's own CUDA graph on the lent GPU.

The graph at 376 rows (the bucket of W3-1000's mean decode batch, 374) is replayed with each
row at context 1 (projections, norms, sampling-free logits: everything but attention) and at
the W3-1000 mix (1000 to 2000 keys, longest first, as the scheduler orders them); the
difference is attention, shown in TB/s of KV read against the same run's copy bandwidth.
Each with the decode kernel at 2 and 3 pipeline stages and with PDL on and off (graphs
recaptured each time).

    PYTHONPATH=. python3 benchmarks/gpu_w3_decode.py
"""

from __future__ import annotations

import json
import os
import random

import torch

from lantau import LLM
from lantau.bench.offline import measure_ceilings, replay_ms
from lantau.kernels import paged_attention as pa
from lantau.kernels import pdl

BS = 376


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    copy = measure_ceilings(torch.device("cuda"))["copy_tb_s"]
    llm = LLM("random:llama3-8b", max_model_len=4096, max_num_seqs=384)
    runner = llm.engine.core.runner
    rng = random.Random(0)
    lens = sorted((rng.randrange(1000, 2000) for _ in range(BS)), reverse=True)
    cfg = llm.config.model_config
    kv_bytes = sum(lens) * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    results, table = {}, []
    for stages in (2, 3):
        for use_pdl in (True, False):
            pa._DECODE_STAGES = stages
            pdl.set_enabled(use_pdl)
            runner.capture_cuda_graphs()
            graphs = runner.graphs
            graph = graphs.graphs[BS][0]
            graphs.slot_mapping[:BS].fill_(-1)
            graphs.seq_lens[:BS].fill_(1)
            base = replay_ms(graph, 20)
            offset = 0
            for i, n in enumerate(lens):  # distinct blocks per row, as real requests have
                nblk = -(-n // 16)
                graphs.block_tables[i, :nblk] = torch.arange(
                    offset, offset + nblk, device="cuda", dtype=torch.int32
                )
                offset += nblk
            graphs.seq_lens[:BS] = torch.tensor(lens, device="cuda", dtype=torch.int32)
            full = replay_ms(graph, 20)
            attn = full - base
            key = f"stages {stages}, PDL {'on' if use_pdl else 'off'}"
            results[key] = {"step_ms": full, "no_attention_ms": base, "attention_ms": attn}
            table.append(
                f"| {key} | {full:.2f} ms | rest {base:.2f} ms, attention {attn:.2f} ms = "
                f"{kv_bytes / attn / 1e9:.2f} TB/s of KV (copy {copy} TB/s) |"
            )
            print(table[-1], flush=True)
            graphs.seq_lens.fill_(1)
            graphs.block_tables.zero_()
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_w3_decode.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n| W3-1000 decode graph, {BS} rows | step | split |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
