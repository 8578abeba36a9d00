"""The serving stack's wheels for a GPU machine that lacks it and has no internet (the H200
image: PyTorch, Triton and transformers, no web server): Python 3.12 manylinux wheels of every
package `lantau serve`, `lantau bench serve` and the model repository need beyond that image,
downloaded with pip into a folder to carry there (default `.whl/`, git-ignored), their total
size printed against the device's 64 MiB carry limit.

    python3 benchmarks/device_wheels.py            # then: benchmarks/make_tokenizer_gguf.py

On the machine, before the benchmark:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site:$PWD/.gl

uvicorn comes with httptools (without it uvicorn parses HTTP with h11 in pure Python and the
frontend streams at about half the rate; `lantau serve` warns then) and uvloop; py-spy is for
gpu_serve.py's --profile-core.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PACKAGES = [
    # the HTTP frontend
    "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "typing-extensions", "anyio", "sniffio", "idna", "uvicorn[standard]", "h11", "click",
    "httptools", "uvloop", "websockets", "watchfiles", "python-dotenv",
    # the engine core's socket and messages, the tokenizer GGUF
    "pyzmq", "msgspec", "orjson", "gguf",
    # Triton's API over gRPC and HTTP, and its client for the model repository's tests
    "tritonclient", "grpcio", "protobuf>=5,<7", "python-rapidjson",
    # metrics, `lantau bench serve`'s client, the core's profiler
    "prometheus-client", "nvidia-ml-py", "aiohttp", "multidict", "yarl", "frozenlist",
    "aiosignal", "aiohappyeyeballs", "propcache", "attrs", "py-spy",
]  # fmt: skip
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_34_x86_64", "any"]  # fmt: skip
CARRY_LIMIT = 64 << 20


def download_command(out: Path, python_version: str) -> list[str]:
    abi = "cp" + python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "--abi", abi,
           "--abi", "abi3", "--abi", "none", "--dest", str(out)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + PACKAGES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".whl", help="the folder the wheels go to")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(out, args.python_version), check=True)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels in {out}: {size / 2**20:.1f} MiB of the device's "
          f"{CARRY_LIMIT >> 20} MiB carry limit")  # fmt: skip
    if size > CARRY_LIMIT:
        sys.exit("over the carry limit: drop what the run does not need")


if __name__ == "__main__":
    main()
