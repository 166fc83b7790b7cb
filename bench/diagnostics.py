"""Benchmark: the cost of ``Diagnostics(every=N)`` on a fit, and of ``lr_find``, side by side.

    .venv/bin/python -m bench.diagnostics [--epochs 5] [--rounds 5]

The digits MLP (64-128-10, ReLU, Adam 3e-3, batch 32, 1,200 training rows: 38 updates an epoch,
one thread) is fitted without the callback and with ``every`` = 50, 10 and 1, the variants
interleaved round by round so a busy machine slows them alike. Printed per variant: the median
wall seconds and process CPU seconds of a fit, and their ratios to the fit without diagnostics;
then the wall time of ``lr_find`` (100 updates) on the same net.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nnx_es import Trainer
    from nnx_es import Diagnostics
    from nnx_es.diagnostics.lr_range import lr_find

    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    data = TensorDataset(x[:1200], y[:1200])

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    root = Path(tempfile.mkdtemp(prefix="bench-diagnostics-"))
    variants: dict[str, int | None] = {"none": None, "every=50": 50, "every=10": 10, "every=1": 1}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, every in variants.items():
                model = net()
                trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=3e-3), nn.CrossEntropyLoss(),
                                  runs_root=root, run_id=f"{name.replace('=', '')}-{r}", progress=False,
                                  callbacks=[Diagnostics(every=every)] if every else [])
                w0, c0 = time.perf_counter(), time.process_time()
                trainer.fit(loader(), epochs=args.epochs)
                if r:
                    wall[name].append(time.perf_counter() - w0)
                    cpu[name].append(time.process_time() - c0)
        base_w, base_c = statistics.median(wall["none"]), statistics.median(cpu["none"])
        print(f"digits MLP, {args.epochs} epochs x 38 updates, median of {args.rounds} rounds (interleaved)")
        print(f"{'variant':<10} {'wall s':>8} {'ratio':>7} {'cpu s':>8} {'ratio':>7}")
        for name in variants:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            print(f"{name:<10} {w:>8.3f} {w / base_w:>7.3f} {c:>8.3f} {c / base_c:>7.3f}")
        w0 = time.perf_counter()
        result = lr_find(net(), lambda params: torch.optim.Adam(params), nn.CrossEntropyLoss(), loader())
        print(f"lr_find: {time.perf_counter() - w0:.2f} s wall; {result}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
