"""Benchmark: seconds per point of ``nnx-es crashtest`` against :func:`nnx_es.testing.crash_test`.

    .venv/bin/python -m bench.crashtest_points [--few 2] [--many 6] [--epochs 3] [--jobs 2]

One toy set-up (a 4-8-2 MLP, 32 rows, batch 8, Adam) as a script that calls ``fit`` itself and as
a ``build`` of the API. Each path runs twice, with ``--few`` and ``--many`` sampled points (seed 0);
seconds per point is the difference of the two wall times over the difference of the points, so
the uninterrupted reference run and the start-up cost drop out. The CLI runs as a user runs it
(``python -m nnx_es crashtest``, a fresh interpreter); the API runs in this process, warmed by a
one-point test first (as a test session is after its first crash test).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = '''
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nnx_es import Trainer


def build(runs_root="runs", run_id="r"):
    torch.manual_seed(0)
    x = torch.randn(48, 4); y = (x[:, 0] > 0).long()
    train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=16)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=runs_root, run_id=run_id,
                      seed=0, progress=False)
    return trainer, train, val


if __name__ == "__main__":
    trainer, train, val = build()
    trainer.fit(train, val, epochs=int(sys.argv[1]))
'''


def _cli(work: Path, points: int, epochs: int, jobs: int) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "nnx_es", "crashtest", "train.py", "--points", str(points),
                          "--jobs", str(jobs), "--", str(epochs)], cwd=work, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"nnx-es crashtest failed:\n{out.stdout}\n{out.stderr[-3000:]}")
    return elapsed


def _api(work: Path, points: int, epochs: int, jobs: int) -> float:
    import runpy

    from nnx_es.testing import crash_test

    build = runpy.run_path(str(work / "train.py"), run_name="bench_toy")["build"]
    crash_test(build, epochs=1, points=1, workers=jobs)  # the first fit's one-time costs (torch._dynamo...)
    t0 = time.perf_counter()
    report = crash_test(build, epochs=epochs, points=points, workers=jobs)
    elapsed = time.perf_counter() - t0
    if not report.ok:
        raise SystemExit(str(report))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--few", type=int, default=2)
    ap.add_argument("--many", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "train.py").write_text(SCRIPT)
        env_path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env_path])
        for name, run in (("api", _api), ("cli", _cli)):
            few, many = run(work, args.few, args.epochs, args.jobs), run(work, args.many, args.epochs, args.jobs)
            per = (many - few) / (args.many - args.few)
            print(f"{name}: {args.few} points {few:.1f} s, {args.many} points {many:.1f} s -> {per:.2f} s per point "
                  f"({args.epochs} epochs, {args.jobs} jobs)", flush=True)


if __name__ == "__main__":
    main()
