"""The runs of the elastic-mode tests (test_resize.py), one phase per torchrun launch.

    python -m torch.distributed.run --nproc-per-node=W ... resize_script.py OUT_DIR PHASE

Every run trains the same small model (no dropout: the comparison with one process is of
the arithmetic alone) on an ``elastic_loader`` of ``ROWS`` rows with row ids, global batch
``G`` and microbatches of at most ``MICRO`` rows, with ``fit(..., resume="auto")``:

* ``first`` (2 ranks): run ``elastic`` to the end of epoch 0; run ``plain`` (a plain
  ``train_loader``, elastic mode off) to the end of epoch 0;
* ``shrink`` (1 rank): run ``elastic`` on to the end of epoch 1; run ``plain`` resumed on 1 rank
  (refused: its error is the result); run ``reference``, all ``EPOCHS`` epochs uninterrupted;
* ``grow`` (4 ranks): run ``elastic`` on to the end of epoch ``EPOCHS - 1``.

Each rank writes ``OUT_DIR/<run>-<phase>.rank<r>.json``: its final parameters (float64 lists,
exact for float32), the row ids of every microbatch it trained (in order) and its plan's
accumulation, a SHA-256 of its torch RNG state when training began and after the fit, the run's
status and counters -- or the error a refused fit raised.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import launch  # noqa: E402
from nnx_es import Callback, Scheduler, Trainer  # noqa: E402
from nnx_es.distributed import DDP, elastic_loader, shutdown, train_loader, validation_loader  # noqa: E402
from nnx_es.rows import with_row_ids  # noqa: E402

torch.set_num_threads(1)

EPOCHS = 3
ROWS, G, MICRO, SEED = 44, 8, 2, 5  # 5 global batches of 8 rows an epoch (4 rows left out); 1 rank: 4 x 2 rows


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g))


def val_set() -> TensorDataset:
    g = torch.Generator().manual_seed(8)
    return TensorDataset(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g))


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _rng_hash() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


class Rows(Callback):
    """Keeps the row ids of every microbatch this rank trains, and its RNG state when training begins."""

    distributed = "all"

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.rng_at_begin = ""

    def on_train_begin(self, ctx) -> None:
        self.rng_at_begin = _rng_hash()

    def on_batch_end(self, ctx) -> None:
        self.batches.append([int(i) for i in ctx.batch["idx"]])


def _train(out: Path, ddp: DDP, run_id: str, epochs: int, *, elastic: bool = True) -> dict:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    decay = Scheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s)), clock="optimizer_update",
                      name="decay")
    rows = Rows()
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), schedulers=[decay], monitor="val_loss", callbacks=[rows],
                      runs_root=out / "runs", run_id=run_id, distributed=ddp, progress=False)
    data = with_row_ids(dataset())
    train = elastic_loader(data, G, microbatch=MICRO, seed=SEED) if elastic else train_loader(data, 4, seed=SEED)
    try:
        result = trainer.fit(train, validation_loader(val_set(), 4), epochs=epochs, resume="auto")
    except Exception as exc:  # noqa: BLE001 - a refusal is this run's result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {
        "params": {k: v.detach().double().flatten().tolist() for k, v in model.state_dict().items()},
        "batches": rows.batches, "accumulation": train.sampler.plan.accumulation if elastic else 1,
        "rng_at_begin": rows.rng_at_begin, "rng_after": _rng_hash(),
        "status": result.status, "step": result.counters.step, "epoch": result.counters.epoch,
    }


def main() -> int:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    ddp = DDP(timeout_seconds=20)
    world = ddp.world()
    runs = {"first": [("elastic", 1, True), ("plain", 1, False)],
            "shrink": [("elastic", 2, True), ("plain", 2, False), ("reference", EPOCHS, True)],
            "grow": [("elastic", EPOCHS, True)]}[phase]
    for name, epochs, elastic in runs:
        launch.write_result(out, f"{name}-{phase}", world.rank, _train(out, ddp, name, epochs, elastic=elastic))
    shutdown(timeout_seconds=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
