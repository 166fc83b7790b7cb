"""Benchmark: what the log's durability flags cost per epoch, and the power-loss exploration.

    .venv/bin/python -m bench.powerloss [--reps 7] [--epochs 4] [--dir PATH]   # the cost
    .venv/bin/python -m bench.powerloss --explore [--states 2000] [--seed 0]     # the exploration

**Cost.** The digits MLP (64-128-10, batch 32, 1797 rows, one thread) trains ``--epochs`` epochs
with the log's LMDB flags (``events.lmdbenv.DURABILITY``) of before 2026-12-03 (``sync=False,
metasync=True``: MDB_NOSYNC, ``env.sync`` at commits only) and of now (``sync=True,
metasync=False``: every write transaction syncs its pages, MDB_NOMETASYNC), alternating in one
process (the order flips every rep: paired reps); ms/epoch is the fit's wall time over its epochs.
fsyncs/epoch are counted, not guessed: one more fit per flag setting runs in a fresh interpreter
under the tracing shim (:mod:`nnx_es.testing.tracer`) and every ``fsync``/``fdatasync`` it made
under the runs root is counted (LMDB's from C included). Runs go to ``--dir`` (default: a
temporary directory under ``/var/tmp``, a disk: on tmpfs an fsync costs nothing).

**Exploration.** :func:`nnx_es.testing.power_loss_test` with a large budget on small runs: lag 0
and ``"epoch"``, log-only blobs (a small model) and file blobs with retention and a history
journal (a wide one), under the new flags and the old ones; prints states explored and violations
(grouped by the promise broken) per set-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["FLAGS", "count_syncs", "epoch_ms", "explore", "main"]

#: the log's LMDB flags: before 2026-12-03 and now
FLAGS = {"old": {"sync": False, "metasync": True}, "new": {"sync": True, "metasync": False}}


def _set_flags(name: str) -> None:
    import events.lmdbenv

    events.lmdbenv.DURABILITY.clear()
    events.lmdbenv.DURABILITY.update(FLAGS[name])


def _digits_fit(runs: Path, run_id: str, epochs: int) -> float:
    """One digits fit; its wall seconds."""
    import torch
    from torch import nn

    from bench.overhead import digits_loader, make_net
    from nnx_es import Trainer

    net = make_net()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=runs,
                      run_id=run_id, seed=0, progress=False)
    t0 = time.perf_counter()
    trainer.fit(digits_loader(), epochs=epochs)
    return time.perf_counter() - t0


def epoch_ms(runs: Path, *, reps: int, epochs: int) -> dict[str, list[float]]:
    """ms/epoch of each flag setting, ``reps`` paired reps (one warm-up fit first, not counted)."""
    import torch

    torch.set_num_threads(1)
    _digits_fit(runs, "warmup", 1)
    out: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(reps):
        for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            _set_flags(name)
            out[name].append(1000 * _digits_fit(runs, f"{name}{rep}", epochs) / epochs)
    _set_flags("new")
    return out


def count_syncs(runs: Path, *, epochs: int) -> dict[str, float]:
    """fsync + fdatasync calls per epoch of each flag setting (a traced fresh interpreter each)."""
    from nnx_es.testing.tracer import build_shim, read_trace, traced_env

    lib = build_shim()
    out = {}
    for name in FLAGS:
        root = runs / f"traced-{name}"
        root.mkdir(parents=True)
        trace = runs / f"trace-{name}.bin"
        env = traced_env(lib, trace, root)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)
        subprocess.run([sys.executable, "-m", "bench.powerloss", "--traced-fit", name, str(root), str(epochs)],
                       env=env, check=True)
        syncs = sum(1 for op in read_trace(trace) if op.op in ("fsync", "fdatasync"))
        out[name] = syncs / epochs
    return out


# --- the exploration's set-ups (module level: the traced interpreter imports them) -------------


def _setup(runs_root: Path, run_id: str, *, wide: bool, lag: Any) -> Any:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nnx_es import HistoryJournal, Trainer, with_row_ids
    from nnx_es.testing import Fit

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    hidden = (nn.Linear(4, 512), nn.Tanh(), nn.Linear(512, 128), nn.Tanh(), nn.Linear(128, 2)) if wide else (
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net = nn.Sequential(*hidden)
    wrap = with_row_ids if wide else (lambda ds: ds)
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.01), nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=runs_root, run_id=run_id, seed=0, progress=False, checkpoint_lag=lag,
                      history=HistoryJournal(window=1, chunk_rows=8) if wide else None)
    train = DataLoader(wrap(TensorDataset(x[:48], y[:48])), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return Fit(trainer, train, DataLoader(wrap(TensorDataset(x[48:], y[48:])), batch_size=16))


def small_lag0(runs_root: Path, run_id: str) -> Any:
    return _setup(runs_root, run_id, wide=False, lag=0)


def small_lag_epoch(runs_root: Path, run_id: str) -> Any:
    return _setup(runs_root, run_id, wide=False, lag="epoch")


def wide_lag0(runs_root: Path, run_id: str) -> Any:
    return _setup(runs_root, run_id, wide=True, lag=0)


def wide_lag_epoch(runs_root: Path, run_id: str) -> Any:
    return _setup(runs_root, run_id, wide=True, lag="epoch")


def old_small_lag0(runs_root: Path, run_id: str) -> Any:
    _set_flags("old")
    return small_lag0(runs_root, run_id)


def old_small_lag_epoch(runs_root: Path, run_id: str) -> Any:
    _set_flags("old")
    return small_lag_epoch(runs_root, run_id)


def old_wide_lag0(runs_root: Path, run_id: str) -> Any:
    _set_flags("old")
    return wide_lag0(runs_root, run_id)


SETUPS = {"new": (small_lag0, small_lag_epoch, wide_lag0, wide_lag_epoch),
          "old": (old_small_lag0, old_small_lag_epoch, old_wide_lag0)}


def explore(*, states: int, seed: int, epochs: int = 3, flags: tuple[str, ...] = ("new", "old")) -> list[dict[str, Any]]:
    """Run the power-loss test of every set-up of :data:`SETUPS` for ``flags``; one row each."""
    from nnx_es.testing import power_loss_test

    rows = []
    for name in flags:
        for build in SETUPS[name]:
            report = power_loss_test(build, epochs=epochs, states=states, seed=seed)
            rows.append({"flags": name, "setup": build.__name__, "points": report.available,
                         "states": len(report.tried), "violations": len(report.failures),
                         "by_check": {c: len(fs) for c, fs in report.groups().items()},
                         "elapsed_s": round(report.elapsed_s, 1), "report": str(report)})
            print(f"{name:>3} {build.__name__:<20} {report.available:>4} points {len(report.tried):>5} states "
                  f"{len(report.failures):>4} violations  ({report.elapsed_s:.0f} s)", flush=True)
            for check, n in rows[-1]["by_check"].items():
                print(f"      {n:>4} x {check}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (default: under /var/tmp)")
    parser.add_argument("--explore", action="store_true", help="run the power-loss exploration instead")
    parser.add_argument("--states", type=int, default=2000, help="--explore: crash states per set-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flags", default="new,old", help="--explore: which flags (new,old)")
    parser.add_argument("--traced-fit", nargs=3, metavar=("FLAGS", "RUNS", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.traced_fit:
        import torch

        torch.set_num_threads(1)
        name, runs, epochs = args.traced_fit
        _set_flags(name)
        _digits_fit(Path(runs), "traced", int(epochs))
        return 0
    if args.explore:
        explore(states=args.states, seed=args.seed, flags=tuple(args.flags.split(",")))
        return 0
    base = args.dir or Path(tempfile.mkdtemp(prefix="nnx_es-powerloss-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    base.mkdir(parents=True, exist_ok=True)
    try:
        ms = epoch_ms(base / "timed", reps=args.reps, epochs=args.epochs)
        syncs = count_syncs(base / "counted", epochs=args.epochs)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"digits MLP, {args.epochs} epochs a fit, {args.reps} paired reps, runs on {base}")
    for name, flags in FLAGS.items():
        print(f"  {name} {flags}: median {med[name]:.1f} ms/epoch (reps {', '.join(f'{v:.1f}' for v in ms[name])}), "
              f"{syncs[name]:.1f} fsyncs/epoch")
    print(f"  new/old: {med['new'] / med['old']:.3f}x ms/epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
