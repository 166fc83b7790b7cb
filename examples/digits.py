"""The main job: train an MLP on scikit-learn's handwritten digits, then audit the run.

    python examples/digits.py [--epochs 100] [--runs runs] [--run-id ID] [--seed 0]

* data: ``sklearn.datasets.load_digits`` (1,797 real 8x8 images, shipped with
  scikit-learn); a fixed-seed split into train (60 %), validation (20 %), test (20 %);
* model: 64-128-10 MLP, Adam, ReduceLROnPlateau + EarlyStopping + BEST, all on
  one monitor (validation loss);
* prints a per-epoch summary, the held-out test accuracy of BEST (exit 1 when
  below 0.95), then runs ``tools/replay`` on the run and shows that it is clean.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import EarlyStopping, Monitor, NNModel, Scheduler

REPO = Path(__file__).resolve().parents[1]


def digits_splits(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train/validation/test tensors: x (N, 64) float32 in [0, 1], y (N,) int64."""
    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np / 16.0, dtype=torch.float32)
    y = torch.tensor(y_np, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = int(0.6 * len(x)), int(0.2 * len(x))
    parts = {"train": perm[:n_train], "val": perm[n_train : n_train + n_val], "test": perm[n_train + n_val :]}
    return {k: (x[idx], y[idx]) for k, idx in parts.items()}


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=100, help="epoch budget (early stopping may end sooner)")
    ap.add_argument("--runs", type=Path, default=REPO / "runs", help="runs root directory")
    ap.add_argument("--run-id", default=None, help="run id (default: timestamp + random suffix)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-test-accuracy", type=float, default=0.95)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    data = digits_splits(args.seed)
    train_loader = DataLoader(
        TensorDataset(*data["train"]), batch_size=32, shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    val_loader = DataLoader(TensorDataset(*data["val"]), batch_size=256)

    torch.manual_seed(args.seed)
    model = NNModel(make_net())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=3)

    t0 = time.perf_counter()
    run = model.train(
        train_loader, val_loader, epochs=args.epochs, optimizer=optimizer, loss=nn.CrossEntropyLoss(),
        monitor=Monitor("val_loss", mode="min", min_delta=1e-4),
        schedulers=[Scheduler(plateau, clock="epoch", name="plateau")],
        callbacks=[EarlyStopping(patience=6)],
        runs_root=args.runs, run_id=args.run_id, seed=args.seed,
    )
    train_s = time.perf_counter() - t0

    print(f"run {run.run_id}  ({run.run_dir})")
    print(f"{'epoch':>5} {'loss':>8} {'acc':>6} {'val_loss':>9} {'val_acc':>7} {'lr':>9}  best")
    for r in run.history:
        lr = next(iter(r.lrs.values()))[0]
        mark = "*" if r.improved else ""
        print(f"{r.epoch:>5} {r.train['loss']:>8.4f} {r.train.get('accuracy', math.nan):>6.3f} "
              f"{r.val.get('val_loss', math.nan):>9.4f} {r.val.get('val_accuracy', math.nan):>7.3f} {lr:>9.2e}  {mark}")

    best_epoch = model.load(run.run_dir, "best")
    x_test, y_test = data["test"]
    accuracy = float((model.predict(x_test) == y_test).float().mean())
    print(f"status {run.status}; {len(run.history)} epochs committed; {run.counters.step} optimizer updates; "
          f"{run.events} events; training took {train_s:.2f} s")
    print(f"BEST is epoch {best_epoch}: held-out test accuracy {accuracy:.4f} on {len(y_test)} images")

    print(f"\n$ tools/replay {run.run_dir}")
    sys.stdout.flush()
    audit = subprocess.run([sys.executable, str(REPO / "tools" / "replay"), run.run_dir])
    if audit.returncode != 0:
        print(f"replay found violations (exit {audit.returncode})", file=sys.stderr)
        return 1
    if accuracy < args.min_test_accuracy:
        print(f"test accuracy {accuracy:.4f} is below {args.min_test_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
