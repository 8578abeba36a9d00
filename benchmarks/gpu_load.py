"""W6 on one GPU: how long an 8B engine takes to load, against HF `from_pretrained` of the same
weights and against reading the same bytes from disk, in the same run, cold page cache where
the machine lets us drop it (as root: `echo 3 > /proc/sys/vm/drop_caches`); then the time from
`lantau serve REPO` to ready, by stage.

    PYTHONPATH=. python3 benchmarks/gpu_load.py --work /tmp/w6 --out $OUT
    # the children (build, loads, serve) run with --python (default: this interpreter)

Stages: (1) `lantau build random:llama3-8b --out WORK/repo/llama/1` (bf16, safetensors shards,
manifest); (2) the same weights written as an HF folder (q/k/v and gate/up split back to HF
names, HF's sharded layout); (3) bytes read from disk (all threads, and one); (4) lantau's
load (`build_model` of the engine folder on CUDA, checksums on, then off); (5) HF
`AutoModelForCausalLM.from_pretrained(..., device_map="cuda")`; (6) `lantau serve
--model-repository WORK/repo` to a 200 on /health, with the engine's start-up stages from
/status, then an unload (GPU memory read before the server, served, after the unload) and a
load again through the API (warm page cache). --warm times lantau's load and HF's once more
right after their cold ones, their files in the page cache (W6-warm). Each timed load runs in
a fresh process whose CUDA context is made before the clock starts. A short table comes last;
everything is in WORK/w6.json (and $OUT/w6.json with --out). No network is used.

With --compile-kernels the build also keeps the compiled Triton kernels in the engine folder
(`lantau build --compile-kernels`), and (6) runs twice, each server with an empty Triton cache
of its own (TRITON_CACHE_DIR=WORK/triton-cache, wiped: a fresh machine): first with the
folder's kernels/ moved aside (every kernel compiles at start-up), then with them (seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpu_serve import free_port, launch_until_ready

GB = 1e9


def drop_page_cache(enabled: bool = True) -> bool:
    """Cold page cache: True when the kernel took the request (root on a real host)."""
    if not enabled:
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(
    python: str, code: str, *argv: str, timeout: float = 900, env: dict | None = None
) -> dict:
    """Run `code` in a fresh interpreter (`env`: its environment, default ours); its last
    stdout line is a JSON object."""
    done = subprocess.run(
        [python, "-c", code, *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build(python: str, model: str, engine_dir: Path, device: str, kernels: bool) -> float:
    if engine_dir.exists():
        shutil.rmtree(engine_dir)
    start = time.perf_counter()
    subprocess.run(
        [python, "-m", "lantau.cli", "build", model, "--out", str(engine_dir), "--dtype", "bf16",
         "--device", device, *(["--compile-kernels"] if kernels else [])],
        check=True,
    )  # fmt: skip
    return time.perf_counter() - start


HF_FOLDER_CODE = r"""
import json, sys, torch, transformers
from pathlib import Path
from safetensors.torch import load_file, save_file
from lantau.model.manifest import read_manifest
engine, out = Path(sys.argv[1]), Path(sys.argv[2])
m = read_manifest(engine)
c = m.model_config
out.mkdir(parents=True, exist_ok=True)
transformers.LlamaConfig(
    vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
    rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
    tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
    eos_token_id=list(c.eos_token_ids), torch_dtype="bfloat16",
    rope_scaling=None if c.rope_scaling is None else {
        "rope_type": c.rope_scaling.rope_type, "factor": c.rope_scaling.factor,
        "low_freq_factor": c.rope_scaling.low_freq_factor,
        "high_freq_factor": c.rope_scaling.high_freq_factor,
        "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings},
).save_pretrained(out)
q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
i = c.intermediate_size
weight_map, total = {}, 0
for n, shard in enumerate(m.shards):
    tensors = {}
    for name, t in load_file(str(engine / shard)).items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                tensors[name.replace("qkv_proj", part)] = piece.contiguous()
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.split([i, i])):
                tensors[name.replace("gate_up_proj", part)] = piece.contiguous()
        else:
            tensors[name] = t
    file = f"model-{n + 1:05d}-of-{len(m.shards):05d}.safetensors"
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    for name, t in tensors.items():
        weight_map[name] = file
        total += t.numel() * t.element_size()
(out / "model.safetensors.index.json").write_text(
    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
print(json.dumps({"bytes": total}))
"""

READ_CODE = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
files, threads = sys.argv[1].split(","), int(sys.argv[2])
def read(path):
    buf = bytearray(64 << 20)
    view, total = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total
start = time.perf_counter()
with ThreadPoolExecutor(threads) as pool:
    total = sum(pool.map(read, files))
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": total}))
"""

LANTAU_LOAD_CODE = r"""
import json, sys, time, torch
from pathlib import Path
device = torch.device(sys.argv[3])
if device.type == "cuda":
    torch.cuda.init(); torch.empty(1, device=device); torch.cuda.synchronize()
from lantau.model import engine_loader
from lantau.model.loader import build_model
from lantau.model.manifest import read_manifest
from lantau.model.source import resolve_model_source
folder, verify = Path(sys.argv[1]), sys.argv[2] == "1"
original = engine_loader.load_engine_weights
timing = {}
def timed(*args, **kwargs):
    start = time.perf_counter()
    original(*args, **{**kwargs, "verify_checksums": verify})
    timing["weights_s"] = time.perf_counter() - start
engine_loader.load_engine_weights = timed
start = time.perf_counter()
source = resolve_model_source(str(folder))
m = read_manifest(folder)
model = build_model(source, m.model_config, torch.bfloat16, device, 0)
if device.type == "cuda":
    torch.cuda.synchronize()
total = time.perf_counter() - start
equal = None
if sys.argv[4:] == ["check"]:  # every tensor against safetensors' own read of the shards
    from safetensors import safe_open
    params, equal = engine_loader.engine_tensors(model), True
    for shard in m.shards:
        with safe_open(str(folder / shard), framework="pt", device=str(device)) as f:
            equal = equal and all(torch.equal(f.get_tensor(k), params[k]) for k in f.keys())
print(json.dumps({"seconds": total, **timing, "construct_s": total - timing["weights_s"],
                  "device_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "equal": equal}))
"""

HF_LOAD_CODE = r"""
import json, sys, time, torch
device = torch.device(sys.argv[2])
if device.type == "cuda":
    torch.cuda.init(); torch.empty(1, device=device); torch.cuda.synchronize()
import transformers
start, how = time.perf_counter(), "device_map"
try:  # straight to the device where HF can (device_map needs accelerate)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        sys.argv[1], dtype=torch.bfloat16, device_map=str(device), local_files_only=True)
except (ImportError, ValueError):
    start, how = time.perf_counter(), "to(device)"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        sys.argv[1], dtype=torch.bfloat16, local_files_only=True).to(device)
if device.type == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - start, "how": how,
                  "device_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def tree_env(path: str) -> dict:
    """Our environment with the lantau source tree `path` first on the import path (and not
    the working directory)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return env


def gpu_memory_used() -> float | None:
    """Bytes used on GPU 0 (NVML), or None without it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None


def post(url: str) -> float:
    """POST an empty JSON body; seconds until the answer."""
    start = time.perf_counter()
    request = urllib.request.Request(url, data=b"{}", headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as r:
        r.read()
    return time.perf_counter() - start


def fresh_triton_cache(work: Path) -> dict:
    """The environment of a server on a fresh machine: an empty Triton cache of its own."""
    cache = work / "triton-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    return {**os.environ, "TRITON_CACHE_DIR": str(cache)}


def serve_to_ready(
    python: str, repo: Path, log_path: Path, extra: list[str], env: dict | None = None
) -> dict:
    """`lantau serve REPO` until /health answers 200 (the engine's stages from /status), then
    unload (device memory back to where it was before the server?) and load again (a hot
    load with the page cache warm). `env`: the server's environment (default ours)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [python, "-m", "lantau.cli", "serve", "--model-repository", str(repo),
           "--model-control-mode", "explicit", "--load-model", "llama", "--port", str(port),
           "--grpc-port", "0", *extra]  # fmt: skip
    memory = {"before_serve": gpu_memory_used()}
    proc, ready_s = launch_until_ready(cmd, port, log_path, env)
    try:
        with urllib.request.urlopen(f"{base}/status", timeout=10) as r:
            status = json.loads(r.read())
        memory["served"] = gpu_memory_used()
        unload_s = post(f"{base}/v2/repository/models/llama/unload")
        memory["after_unload"] = gpu_memory_used()
        reload_s = post(f"{base}/v2/repository/models/llama/load")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"seconds": ready_s, "stages": status.get("startup_s", {}), "unload_s": unload_s,
            "reload_s": reload_s, "gpu_memory_bytes": memory}  # fmt: skip


def serve_both_ways(args, work: Path, engine_dir: Path, serve_args: list[str]) -> dict:
    """--compile-kernels: serve from an empty Triton cache without the folder's kernels, then
    with them; the second is the result's "serve"."""
    kernels, aside = engine_dir / "kernels", work / "kernels-aside"
    result = {"kernels": [json.loads(p.read_text()) for p in kernels.glob("*/KERNELS.json")]}
    shutil.rmtree(aside, ignore_errors=True)
    kernels.rename(aside)
    try:
        result["serve_no_kernels"] = serve_to_ready(
            args.python, work / "repo", work / "serve-no-kernels.log", serve_args,
            fresh_triton_cache(work),
        )  # fmt: skip
    finally:
        aside.rename(kernels)
    drop_page_cache(args.drop_cache)
    result["serve"] = serve_to_ready(
        args.python, work / "repo", work / "serve.log", serve_args, fresh_triton_cache(work)
    )
    return result


def describe_stages(serve: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in serve["stages"].items())


def table(result: dict) -> str:
    disk = result["disk_read_parallel"]["seconds"]
    lantau, hf = result["lantau_load"]["seconds"], result.get("hf_load", {}).get("seconds")
    gb = result["engine_bytes"] / GB
    rows = [
        ("disk read, all threads", disk),
        ("disk read, one thread", result["disk_read_one"]["seconds"]),
        ("lantau load (checksums on)", lantau),
        ("lantau load (checksums off)", result["lantau_load_unverified"]["seconds"]),
        ("HF from_pretrained", hf),
    ]
    serve, no_kernels = result.get("serve"), result.get("serve_no_kernels")
    if serve:
        rows.append(("lantau serve REPO -> ready", serve["seconds"]))
    if no_kernels:  # --compile-kernels: both from an empty Triton cache
        rows[-1] = ("serve -> ready, fresh, kernels", result["serve"]["seconds"])
        rows.append(("serve -> ready, fresh, none", no_kernels["seconds"]))
    lines = [
        f"W6 {result['model']} bf16, {gb:.1f} GB; cold page cache: {result['cold_cache']}",
        f"{'stage':<30} {'seconds':>8} {'GB/s':>7}",
    ]
    for name, seconds in rows:
        if seconds is not None:
            lines.append(f"{name:<30} {seconds:>8.2f} {gb / seconds:>7.2f}")
    if serve:
        lines.append(f"serve stages (s): {describe_stages(serve)}")
    if no_kernels:
        lines.append(f"serve stages without kernels/ (s): {describe_stages(no_kernels)}")
        for info in result["kernels"]:
            lines.append(f"kernels/{info['name']}: {info['num_entries']} Triton cache entries, "
                         f"{info['num_files']} files")  # fmt: skip
    if serve:
        lines.append(f"unload {serve['unload_s']:.1f} s; load again (warm cache, API) "
                     f"{serve['reload_s']:.1f} s")  # fmt: skip
    memory = serve["gpu_memory_bytes"] if serve else {"served": None}
    if None not in memory.values():
        lines.append(
            "GPU memory used (GB): before serve {before_serve:.2f}, served {served:.2f}, "
            "after unload {after_unload:.2f}".format(**{k: v / GB for k, v in memory.items()})
        )
    if hf:
        lines.append(f"lantau vs HF: {hf / lantau:.1f}x faster (goal >= 5x)")
    warm, hf_warm = result.get("lantau_load_warm"), result.get("hf_load_warm")
    if warm:
        line = f"warm page cache: lantau {warm['seconds']:.2f} s"
        if hf_warm:
            ratio = hf_warm["seconds"] / warm["seconds"]
            line += f", HF {hf_warm['seconds']:.2f} s: {ratio:.1f}x faster"
        lines.append(line)
    for name, loads in result.get("trees", {}).items():
        if not name:
            continue
        kinds = {"lantau_load": "cold", "lantau_load_unverified": "cold, unverified",
                 "lantau_load_warm": "warm"}  # fmt: skip
        times = "; ".join(f"{kinds[k]} " + " / ".join(f"{r['seconds']:.2f}" for r in rows)
                          for k, rows in loads.items())  # fmt: skip
        checked = [r["equal"] for rows in loads.values() for r in rows if "equal" in r]
        checked = [c for c in checked if c is not None]
        check = f" (weights equal to safetensors' read: {all(checked)})" if checked else ""
        lines.append(f"tree {name}: {times} s{check}")
    lines.append(f"lantau vs disk read: {lantau / disk:.2f}x the disk time (goal <= 1.5x)")
    if serve:
        lines.append(f"serve to ready: {serve['seconds']:.1f} s (goal <= 15 s)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", default=sys.executable, help="interpreter for the children")
    p.add_argument("--work", default="/tmp/lantau-w6", help="repository + HF folder (~32 GB)")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--out", default=None, help="also write w6.json and the logs here")
    p.add_argument("--skip-hf", action="store_true", help="no HF folder, no from_pretrained")
    p.add_argument(
        "--warm", action="store_true",
        help="also each load again at once, its files in the page cache (W6-warm)",
    )  # fmt: skip
    p.add_argument("--reuse", action="store_true", help="keep an engine and HF folder built")
    p.add_argument("--serve-arg", action="append", default=[], help="extra lantau serve args")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument(
        "--compile-kernels", action="store_true",
        help="build with --compile-kernels; serve from an empty Triton cache without, then with "
        "the folder's kernels (CUDA only)",
    )  # fmt: skip
    p.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH",
        help="time lantau's loads with each of these source trees in turn (repeatable; default: "
        "this one); the table shows the first's, every load is in w6.json's trees",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="the trees' loads this many times")
    p.add_argument("--skip-serve", action="store_true", help="no `lantau serve REPO` at the end")
    p.add_argument(
        "--check", action="store_true",
        help="the warm loads also compare every tensor with safetensors' read of the shards",
    )  # fmt: skip
    p.add_argument(
        "--no-drop-cache", dest="drop_cache", action="store_false",
        help="leave the page cache (a shared machine): warm-cache figures",
    )  # fmt: skip
    args = p.parse_args()
    if args.compile_kernels and args.device == "cpu":
        p.error("--compile-kernels compiles for the GPU: it needs --device cuda")
    work = Path(args.work)
    engine_dir, hf_dir = work / "repo" / "llama" / "1", work / "hf"
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": args.model}
    built = (engine_dir / "lantau-engine.json").exists() and (
        not args.compile_kernels or (engine_dir / "kernels").is_dir()
    )
    if not (args.reuse and built):
        result["build_s"] = build(
            args.python, args.model, engine_dir, args.device, args.compile_kernels
        )
        print(f"build: {result['build_s']:.1f} s", flush=True)
    manifest = json.loads((engine_dir / "lantau-engine.json").read_text())
    shards = [str(engine_dir / s) for s in manifest["shards"]]
    result["engine_bytes"] = sum(manifest["files"][s]["size"] for s in manifest["shards"])
    if not args.skip_hf and not (args.reuse and (hf_dir / "config.json").exists()):
        shutil.rmtree(hf_dir, ignore_errors=True)
        start = time.perf_counter()
        run_child(args.python, HF_FOLDER_CODE, str(engine_dir), str(hf_dir))
        print(f"HF folder: {time.perf_counter() - start:.1f} s", flush=True)

    def timed(name: str, code: str, *argv: str, drop: bool = True, env=None) -> dict:
        cold = drop_page_cache(args.drop_cache and drop)
        if drop:
            result["cold_cache"] = cold
        row = result[name] = run_child(args.python, code, *argv, env=env)
        more = "".join(f", {k} {row[k]:.3f}" for k in ("weights_s",) if k in row)
        more += f", equal {row['equal']}" if row.get("equal") is not None else ""
        print(f"{name}: {row['seconds']:.2f} s (cold cache: {cold}{more})", flush=True)
        (work / "w6.json").write_text(json.dumps(result, indent=1))  # so far: a cut run keeps it
        return row

    threads = str(min(len(shards), os.cpu_count() or 1, 16))
    timed("disk_read_parallel", READ_CODE, ",".join(shards), threads)
    timed("disk_read_one", READ_CODE, ",".join(shards), "1")
    trees = dict(t.split("=", 1) for t in args.tree) or {"": ""}
    result["trees"] = {name: {} for name in trees}
    for round_ in range(args.rounds):  # each tree's loads in turn, interleaved
        for name, path in trees.items():
            env = tree_env(path) if path else None
            at = f"@{name}#{round_}" if args.tree else ""
            runs = [("lantau_load", "1", True), ("lantau_load_unverified", "0", True)]
            if args.warm:  # the files just read are in the page cache
                runs.append(("lantau_load_warm", "1", False))
            for key, verify, drop in runs:
                check = ["check"] if args.check and key == "lantau_load_warm" else []
                row = timed(key + at, LANTAU_LOAD_CODE, str(engine_dir), verify, args.device,
                            *check, drop=drop, env=env)  # fmt: skip
                result["trees"][name].setdefault(key, []).append(row)
                result.setdefault(key, row)  # the table's: the first tree's first round
    if not args.skip_hf:
        timed("hf_load", HF_LOAD_CODE, str(hf_dir), args.device)
        if args.warm:
            timed("hf_load_warm", HF_LOAD_CODE, str(hf_dir), args.device, drop=False)
    result["cold_cache"] = drop_page_cache(args.drop_cache)
    serve_args = [*(["--device", "cpu"] if args.device == "cpu" else []), *args.serve_arg]
    if args.device == "cpu":
        serve_args += ["--num-kv-blocks", "64", "--max-model-len", "256"]
    if args.skip_serve:
        pass
    elif args.compile_kernels:
        result.update(serve_both_ways(args, work, engine_dir, serve_args))
    else:
        result["serve"] = serve_to_ready(args.python, work / "repo", work / "serve.log", serve_args)
    text = table(result)
    (work / "w6.json").write_text(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "w6.json", Path(args.out) / "w6.json")
        if not args.skip_serve:
            shutil.copy(work / "serve.log", Path(args.out) / "w6-serve.log")
        if args.compile_kernels and not args.skip_serve:
            shutil.copy(work / "serve-no-kernels.log", Path(args.out) / "w6-serve-no-kernels.log")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
