"""The run of the membership test (test_resize.py): an elastic run that a second torchrun agent joins.

    python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d ... join_script.py OUT_DIR

Trains run ``joined`` (``resize_script``'s model and data, an ``elastic_loader``) for ``EPOCHS``
epochs with ``fit(..., resume="auto")``. In a group of one rank, when epoch ``JOIN_AT`` begins (epoch
``JOIN_AT - 1``'s LAST is committed), the rank writes ``OUT_DIR/ready`` and waits (at most
``WAIT_S``) for the agent to stop it: the test then starts a second agent, whose joining makes
torchrun restart the group on two ranks, which resume the run from that LAST. Each rank of the
group that finishes writes ``OUT_DIR/joined.rank<r>.json``: the group's size, the row ids of every
microbatch it trained, its plan's accumulation, its final parameters and the run's counters.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import launch  # noqa: E402
import resize_script as kit  # noqa: E402
from nnx_es import Callback, Trainer  # noqa: E402
from nnx_es.distributed import DDP, elastic_loader, shutdown  # noqa: E402
from nnx_es.rows import with_row_ids  # noqa: E402

EPOCHS, JOIN_AT, WAIT_S = 4, 2, 90.0


class WaitForJoin(Callback):
    """Alone in its group, at the beginning of epoch ``JOIN_AT``: say so, and wait to be stopped."""

    distributed = "all"

    def __init__(self, out: Path, size: int) -> None:
        self.out, self.size = out, size

    def on_epoch_begin(self, ctx) -> None:
        if self.size == 1 and ctx.epoch == JOIN_AT:
            (self.out / "ready").write_text("epoch 1's LAST is committed; waiting for a second agent\n")
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:  # torchrun stops this worker when the second agent joins
                time.sleep(0.2)


def main() -> int:
    out = Path(sys.argv[1])
    ddp = DDP(timeout_seconds=20)
    world = ddp.world()
    model = kit.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    rows = kit.Rows()
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), callbacks=[rows, WaitForJoin(out, world.size)],
                      runs_root=out / "runs", run_id="joined", distributed=ddp, progress=False)
    train = elastic_loader(with_row_ids(kit.dataset()), kit.G, microbatch=kit.MICRO, seed=kit.SEED)
    result = trainer.fit(train, epochs=EPOCHS, resume="auto")
    launch.write_result(out, "joined", world.rank, {
        "size": world.size, "batches": rows.batches, "accumulation": train.sampler.plan.accumulation,
        "params": {k: v.detach().double().flatten().tolist() for k, v in model.state_dict().items()},
        "status": result.status, "step": result.counters.step, "epoch": result.counters.epoch})
    shutdown(timeout_seconds=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
