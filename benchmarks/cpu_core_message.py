"""The engine core's message to the frontend each step (protocol.CoreOutputs): its bytes and
the time msgspec takes to encode it (the core) and decode it (the frontend's event loop) for N
outputs of one token, microseconds a message.

    .venv/bin/python benchmarks/cpu_core_message.py [--outputs 384] [--calls 2000]

Run it from two trees (PYTHONPATH=TREE PYTHONSAFEPATH=1) for a same-run comparison.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from lantau.engine.protocol import CoreOutputs, StepStats
from lantau.scheduler.output import EngineCoreOutput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", type=int, default=384)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    outputs = [
        EngineCoreOutput(f"cmpl-{i}-0123456789abcdef#0", [1234]) for i in range(args.outputs)
    ]
    message = CoreOutputs(outputs, StepStats())
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreOutputs)
    data = encoder.encode(message)
    start = time.perf_counter()
    for _ in range(args.calls):
        encoder.encode(message)
    encode = (time.perf_counter() - start) / args.calls * 1e6
    start = time.perf_counter()
    for _ in range(args.calls):
        decoder.decode(data)
    decode = (time.perf_counter() - start) / args.calls * 1e6
    print(
        f"{args.outputs} outputs: {len(data)} bytes, encode {encode:.1f} us, decode {decode:.1f} us"
    )


if __name__ == "__main__":
    main()
