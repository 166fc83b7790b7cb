"""Benchmark: the per-microbatch cost of live logging sinks (TensorBoard, CSV) on the digits MLP.

The same fit (bench.overhead's workload: digits, MLP 64-128-10, Adam, batch 32, one thread) with no
sink, with a TensorBoardSink and with a CsvSink, interleaved (A B C, A B C, ...) so drift on a
shared machine hits them alike; prints the median time of each, its ratio to no sink, and the
difference per microbatch. Run: ``python -m bench.sinks [--reps N] [--epochs E]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.overhead import digits_loader, make_net
from nnx_es import CsvSink, TensorBoardSink, Trainer


def _fit(epochs: int, sink: str) -> float:
    root = Path(tempfile.mkdtemp(prefix="nnx_es_bench_sinks_"))
    try:
        net = make_net()
        sinks = {"none": [], "tensorboard": [TensorBoardSink(root / "tb")], "csv": [CsvSink(root / "csv")]}[sink]
        trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), nn.CrossEntropyLoss(), runs_root=root,
                          progress=False, sinks=sinks)
        loader = digits_loader()
        t0 = time.perf_counter()
        trainer.fit(loader, None, epochs=epochs)
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kinds = ("none", "tensorboard", "csv")
    for k in kinds:
        _fit(1, k)  # warm
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.reps):
        for k in kinds:
            times[k].append(_fit(args.epochs, k))
    microbatches = len(digits_loader()) * args.epochs
    base = statistics.median(times["none"])
    print(f"| sink | median s | ratio | per microbatch |\n|---|---|---|---|")
    for k in kinds:
        m = statistics.median(times[k])
        print(f"| {k} | {m:.3f} | {m / base:.3f}x | {(m - base) / microbatches * 1e6:+.1f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
