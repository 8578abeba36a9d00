"""Seconds for the engine core's imports (torch, Triton) and CUDA's init from a cold page cache,
with and without the files they read asked ahead (the lead: torch's import took 4.2 s of the
H200's 16 s serve-repo-ready, its files read one page fault or one .pyc at a time).

    python3 benchmarks/cold_imports.py [--rounds 3] [--arms none,fadvise,read]

A warm child first lists what the imports read, as the engine core lists them for its next
start (lantau/engine/import_ahead.py): every shared library mapped once CUDA is up, then every
module's source and bytecode file. Then, each round, for each arm
in turn, the whole page cache is dropped (root: /proc/sys/vm/drop_caches) and a fresh child
times `import torch`, CUDA's init and `import triton`, after starting a thread that
  none     does nothing;
  fadvise  asks the kernel to read every listed file ahead (posix_fadvise WILLNEED, largest
           libraries first, then the modules' files), as the engine core does;
  read     reads every listed file whole (8 MB reads), the libraries on 4 threads.
The medians by arm are printed last and written to $OUT/cold_imports.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from gpu_load import drop_page_cache

LEARN = r"""
import json, os
import torch
torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
import triton  # noqa: F401
from lantau.engine.import_ahead import loaded_files
libs, mods = loaded_files()
print(json.dumps({"libs": libs, "mods": mods, "lib_bytes": sum(map(os.path.getsize, libs))}))
"""

TIMED = r"""
import json, os, sys, threading, time
t0 = time.monotonic()
arm, listing = sys.argv[1], json.loads(open(sys.argv[2]).read())

def read(paths):
    for p in paths:
        try:
            with open(p, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
        except OSError:
            pass

if arm == "fadvise":  # as the engine core does (lantau/engine/import_ahead.py)
    from lantau.engine.import_ahead import advise
    threading.Thread(target=advise, args=(listing["libs"] + listing["mods"],), daemon=True).start()
elif arm == "read":
    libs = listing["libs"]
    for i in range(4):
        threading.Thread(target=read, args=(libs[i::4],), daemon=True).start()
    threading.Thread(target=read, args=(listing["mods"],), daemon=True).start()
t1 = time.monotonic()
import torch
t2 = time.monotonic()
torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
t3 = time.monotonic()
import triton  # noqa: F401
t4 = time.monotonic()
print(json.dumps({"arm": arm, "start": t1 - t0, "torch": t2 - t1, "cuda": t3 - t2,
                  "triton": t4 - t3, "total": t4 - t0}))
"""


def child(code: str, *argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default="none,fadvise,read")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    listing = child(LEARN)
    path = os.path.join(args.out, "cold_imports_files.json")
    with open(path, "w") as f:
        json.dump(listing, f)
    print(
        f"{len(listing['libs'])} libraries ({listing['lib_bytes'] / 1e9:.2f} GB), "
        f"{len(listing['mods'])} module files",
        flush=True,
    )
    arms = args.arms.split(",")
    runs: list[dict] = []
    for _ in range(args.rounds):
        for arm in arms:
            cold = drop_page_cache()
            runs.append({**child(TIMED, arm, path), "cold": cold})
            print(json.dumps(runs[-1]), flush=True)
    keys = ("torch", "cuda", "triton", "total")
    table = {
        arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm) for k in keys}
        for arm in arms
    }
    with open(os.path.join(args.out, "cold_imports.json"), "w") as f:
        json.dump({"runs": runs, "medians": table, "listing": {"libs": listing["libs"]}}, f)
    print("\n| arm | import torch s | CUDA init s | import triton s | total s |")
    print("| --- | --- | --- | --- | --- |")
    for arm, m in table.items():
        cells = " | ".join(f"{m[k]:.2f}" for k in keys)
        print(f"| {arm} | {cells} |")


if __name__ == "__main__":
    main()
