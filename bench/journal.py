"""Benchmark: the history journal keeps the trainer's memory flat as per-row records grow.

A real ``Trainer`` run records 1 M per-row records per epoch (a linear classifier over
1 M rows of 8 features, batches of 8192, ``with_row_ids``) into
``HistoryJournal(window=1, chunk_rows=65536)``; the process's anonymous memory (``RssAnon``
of ``/proc/self/status``: heap and tensors, not the log's or the chunks' mapped pages) is read
at the start of every epoch, after the previous epoch's history step. The same run without a
journal (records in the log, every epoch kept in memory) is the contrast.

    .venv/bin/python -m bench.journal [--epochs 8] [--rows 1000000] [--json]

Pass: from the third epoch on, every reading within +-10 % of the third epoch's
(the first epochs warm up allocators and torch). CPU seconds per epoch are reported beside wall
seconds (the machine is shared: prefer CPU time).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Callback, HistoryJournal, Trainer, read_rows, with_row_ids

__all__ = ["anon_mib", "main", "measure"]


def anon_mib() -> float:
    """This process's anonymous resident memory (``RssAnon``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class _Memory(Callback):
    def __init__(self) -> None:
        self.mib: list[float] = []
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def on_epoch_begin(self, ctx) -> None:  # noqa: ANN001
        gc.collect()
        self.mib.append(anon_mib())
        self.cpu.append(time.process_time())
        self.wall.append(time.perf_counter())


def measure(root: Path, *, rows: int, epochs: int, journal: bool) -> dict[str, object]:
    """One run; its memory per epoch (MiB), seconds per epoch and what it recorded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(rows, generator=g) > 0).long()
    loader = DataLoader(with_row_ids(TensorDataset(x, y)), batch_size=8192, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    memory = _Memory()
    history = HistoryJournal(window=1, chunk_rows=65536) if journal else None
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=root,
                      run_id="journal" if journal else "log", progress=False, callbacks=[memory], history=history)
    trainer.fit(loader, epochs=epochs)
    gc.collect()
    memory.mib.append(anon_mib())
    memory.cpu.append(time.process_time())
    memory.wall.append(time.perf_counter())
    recorded = len(read_rows(trainer.run_dir))
    size = sum(p.stat().st_size for p in trainer.run_dir.rglob("*") if p.is_file())
    return {
        "mode": "journal" if journal else "log",
        "rows_per_epoch": rows, "epochs": epochs, "records": recorded,
        "anon_mib_at_epoch_start": [round(m, 1) for m in memory.mib],
        "cpu_s_per_epoch": [round(b - a, 2) for a, b in zip(memory.cpu, memory.cpu[1:])],
        "wall_s_per_epoch": [round(b - a, 2) for a, b in zip(memory.wall, memory.wall[1:])],
        "run_mib_on_disk": round(size / 2**20, 1),
    }


def flat(mib: list[float], start: int = 2, tolerance: float = 0.10) -> tuple[bool, float]:
    """Whether every reading from ``start`` on is within ``tolerance`` of reading ``start``; the worst ratio."""
    base = mib[start]
    worst = max(abs(m / base - 1) for m in mib[start:])
    return worst <= tolerance, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--contrast-epochs", type=int, default=4, help="epochs of the run without a journal (0: none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="nnx_es-journal-bench-"))
    try:
        results = [measure(root, rows=args.rows, epochs=args.epochs, journal=True)]
        if args.contrast_epochs:
            results.append(measure(root, rows=args.rows, epochs=args.contrast_epochs, journal=False))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok, worst = flat(results[0]["anon_mib_at_epoch_start"])  # type: ignore[arg-type]
    results[0]["flat_within_10pct_from_epoch_2"] = ok
    results[0]["worst_deviation"] = round(worst, 4)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['mode']:>8}: {r['records']:,} records ({r['rows_per_epoch']:,} per epoch x {r['epochs']}), "
                  f"{r['run_mib_on_disk']} MiB on disk")
            print(f"          anon MiB at each epoch's start: {r['anon_mib_at_epoch_start']}")
            print(f"          CPU s per epoch: {r['cpu_s_per_epoch']}  wall s: {r['wall_s_per_epoch']}")
        print(f"journal memory flat within +-10 % from epoch 2: {ok} (worst deviation {worst:.1%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
