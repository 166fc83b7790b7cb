"""Data parallelism: the digits MLP trained by 2 ranks under torchrun, then audited.

    torchrun --standalone --nproc_per_node=2 examples/ddp_supervised.py [--epochs 30] [--runs runs]

Every rank runs this same script. ``train_loader`` deals each epoch's permutation (seeded by
``seed + epoch``) to the ranks; ``validation_loader`` gives each rank the rows ``rank::world``
(every row scored exactly once); ``NNModel.train(..., distributed=DDP())`` wraps the net in
``DistributedDataParallel`` for the fit and agrees every window's denominator, every epoch's
records and decisions (BEST, ReduceLROnPlateau, EarlyStopping) and every commit. Only the
writer rank (rank 0) writes ``runs/<id>/``; every rank returns the same run. Across machines,
the same script runs under ``torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d
--rdzv-endpoint=HOST:PORT`` (docs/guides/multi-machine.md). CPU uses gloo; with CUDA each rank
trains on ``cuda:LOCAL_RANK`` over nccl.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits import REPO, digits_splits, make_net  # noqa: E402

from nnx_es import EarlyStopping, Monitor, NNModel, Scheduler  # noqa: E402
from nnx_es.distributed import DDP, shutdown, train_loader, validation_loader  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--runs", type=Path, default=REPO / "runs")
    ap.add_argument("--run-id", default="ddp-digits", help="a fixed id: a restarted group resumes it")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    ddp = DDP(writer_rank=0, timeout_seconds=60)
    world = ddp.world()  # joins the group torchrun started (gloo on CPU, nccl on cuda:LOCAL_RANK)
    data = digits_splits(args.seed)
    train = train_loader(TensorDataset(*data["train"]), batch_size=16, policy="pad", seed=args.seed)
    val = validation_loader(TensorDataset(*data["val"]), batch_size=256)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = NNModel(make_net())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=3)
    run = model.train(
        train, val, epochs=args.epochs, optimizer=optimizer, loss=nn.CrossEntropyLoss(),
        monitor=Monitor("val_loss", mode="min", min_delta=1e-4),
        schedulers=[Scheduler(plateau, clock="epoch", name="plateau")],
        callbacks=[EarlyStopping(patience=6)],
        runs_root=args.runs, run_id=args.run_id, seed=args.seed, progress=False,
        distributed=ddp, resume="auto",
    )
    code = 0
    if world.is_writer:
        best = run.best_epoch
        print(f"run {run.run_id} ({run.run_dir}): {run.status}, {len(run.history)} epochs, "
              f"{run.counters.step} updates on {world.size} ranks; BEST epoch {best}")
        if run.history:
            last = run.history[-1]
            print(f"last epoch: loss {last.train['loss']:.4f}, val_loss {last.val.get('val_loss', float('nan')):.4f}, "
                  f"val_accuracy {last.val.get('val_accuracy', float('nan')):.4f}")
        audit = subprocess.run([sys.executable, str(REPO / "tools" / "replay"), run.run_dir])
        code = audit.returncode
    shutdown(timeout_seconds=60)
    return code


if __name__ == "__main__":
    sys.exit(main())
