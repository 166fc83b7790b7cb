"""Scenario script run under torchrun: several cases one after another in ONE process group.

    python -m torch.distributed.run ... tests/distributed/scenarios.py OUT_DIR case1,case2,...

Each case is a function ``case(world, out_dir) -> dict`` run on every rank; its result (or the
error it raised: type and message) is written per rank as ``OUT_DIR/<case>.rank<r>.json``
(:func:`launch.write_result`). After each case the ranks meet at a bounded barrier, so a case
that fails on one rank only still leaves the next case a synchronized group.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import launch  # noqa: E402
from nnx_es.distributed import DDP, partition_indices, shard_indices, shutdown  # noqa: E402
from nnx_es.run_state import World  # noqa: E402

torch.set_num_threads(1)

Case = Callable[[World, Path], dict[str, Any]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


# --- part 1: the group, agreement primitives, partitions ------------------------------------


@case
def agree(world: World, out: Path) -> dict[str, Any]:
    t = torch.tensor([float(world.rank + 1), 2.0 ** -30 * (world.rank + 1), float(world.rank)], dtype=torch.float64)
    world.agree(t, "sum")
    mx = world.agree(torch.tensor([float(world.rank)]), "max")
    return {"sum": t.tolist(), "max": mx.tolist(), "flag_any": world.agree_flag(world.rank == 1),
            "flag_none": world.agree_flag(False), "gathered": world.gather({"rank": world.rank}),
            "shared": world.share(f"from {world.rank}"), "size": world.size, "writer": world.is_writer}


@case
def partitions(world: World, out: Path) -> dict[str, Any]:
    from nnx_es.distributed import train_loader, validation_loader

    data = torch.utils.data.TensorDataset(torch.arange(11.0))
    tl = train_loader(data, 2, policy="pad", seed=3)
    rows = {}
    for epoch in (0, 1):
        tl.sampler.set_epoch(epoch)
        rows[epoch] = [int(x) for b in tl for x in b[0]]
    vl = validation_loader(data, 4)
    return {"train": rows, "val": [int(x) for b in vl for x in b[0]],
            "expect0": partition_indices(11, rank=world.rank, world_size=world.size, epoch=0, seed=3),
            "expect_val": shard_indices(11, rank=world.rank, world_size=world.size)}


def main() -> None:
    out = Path(sys.argv[1])
    names = [n for n in sys.argv[2].split(",") if n]
    world = DDP(timeout_seconds=float(os.environ.get("NNX_TEST_PG_TIMEOUT", "30"))).world()
    for name in names:
        if name == "shutdown_missing":  # the last case: rank 1 leaves; the others must raise within the bound
            if world.rank == 1:
                launch.write_result(out, name, world.rank, {"ok": True, "left": True})
                os._exit(0)
            try:
                shutdown(timeout_seconds=3)
                res: dict[str, Any] = {"ok": True, "raised": None}
            except RuntimeError as exc:
                res = {"ok": True, "raised": "RuntimeError", "message": str(exc)}
            launch.write_result(out, name, world.rank, res)
            os._exit(0)
        try:
            res = {"ok": True, **CASES[name](world, out)}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            res = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                   "mro": [c.__name__ for c in type(exc).__mro__], "traceback": traceback.format_exc()}
        launch.write_result(out, name, world.rank, res)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    shutdown(timeout_seconds=30)
    shutdown(timeout_seconds=30)  # a second call does nothing
    launch.write_result(out, "shutdown_ok", world.rank, {"ok": True, "initialized": dist.is_initialized()})


if __name__ == "__main__":
    main()
