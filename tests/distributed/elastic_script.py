"""A restartable 2-rank training script for the elastic test (run under torchrun).

    python -m torch.distributed.run --max-restarts=1 ... elastic_script.py OUT_DIR [KILL [RUNS]]

Trains the same small model (with dropout: each rank draws its own masks) once per name of
``RUNS`` (default ``reference,elastic``), one after another in one process group, with
``Trainer(run_id=<name>, runs_root=OUT_DIR/runs, distributed=DDP())`` and
``fit(..., resume="auto")``. A run whose results this rank already wrote is skipped (a
restarted generation goes on where the killed one was). In run ``elastic``, ``KILL`` =
``rank:epoch:batch`` (``""``: none) makes that rank SIGKILL itself after that microbatch
(0-based), once -- a marker file ``OUT_DIR/elastic.killed`` records that it did -- so torchrun
restarts the group and the new generation continues the run from LAST.

Each rank writes ``OUT_DIR/<run>.rank<r>.json``: its final parameters (float64 lists, exact for
float32), a SHA-256 of its torch RNG state after the fit, the run's status and counters, and the
restart count torchrun gave it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import launch  # noqa: E402
from nnx_es import Callback, Trainer  # noqa: E402
from nnx_es.distributed import DDP, shutdown, train_loader  # noqa: E402

torch.set_num_threads(1)

EPOCHS = 3
ROWS, BATCH, SEED = 40, 4, 5  # 20 rows per rank: 5 microbatches an epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g))


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 3))


class KillOnce(Callback):
    """SIGKILL this process after microbatch ``batch`` of ``epoch`` on ``rank``, unless ``marker`` exists."""

    distributed = "all"

    def __init__(self, rank: int, epoch: int, batch: int, marker: Path) -> None:
        self.rank, self.epoch, self.batch, self.marker = rank, epoch, batch, marker
        self.me = int(os.environ.get("RANK", "0"))

    def on_batch_end(self, ctx) -> None:
        if self.me == self.rank and ctx.epoch == self.epoch and ctx.batch_index == self.batch \
                and not self.marker.exists():
            self.marker.write_text(f"killed rank {self.rank} at epoch {self.epoch} batch {self.batch}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def _train(out: Path, ddp: DDP, run_id: str, callbacks: list) -> dict:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), runs_root=out / "runs", run_id=run_id,
                      distributed=ddp, callbacks=callbacks, progress=False)
    result = trainer.fit(train_loader(dataset(), BATCH, seed=SEED), epochs=EPOCHS, resume="auto")
    return {
        "params": {k: v.detach().double().flatten().tolist() for k, v in model.state_dict().items()},
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "status": result.status, "step": result.counters.step, "epoch": result.counters.epoch,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def main() -> int:
    out = Path(sys.argv[1])
    kill = sys.argv[2] if len(sys.argv) > 2 else ""
    names = (sys.argv[3] if len(sys.argv) > 3 else "reference,elastic").split(",")
    ddp = DDP(timeout_seconds=20)
    world = ddp.world()  # initializes the group restart-safely (nnx_es.distributed.elastic)
    for name in names:
        if (out / f"{name}.rank{world.rank}.json").exists():  # a restarted generation skips a finished run
            continue  # (both ranks wrote theirs before any kill: the test kills in a later run)
        callbacks = []
        if kill and name == "elastic":
            r, e, b = (int(v) for v in kill.split(":"))
            callbacks.append(KillOnce(r, e, b, out / "elastic.killed"))
        launch.write_result(out, name, world.rank, _train(out, ddp, name, callbacks))
    shutdown(timeout_seconds=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
