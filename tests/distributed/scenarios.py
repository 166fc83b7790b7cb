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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import launch  # noqa: E402
from nnx_es.distributed import DDP, shutdown  # noqa: E402

torch.set_num_threads(1)

import scenarios_commits  # noqa: E402,F401  (registers its cases)
import scenarios_group  # noqa: E402,F401
import scenarios_trainer  # noqa: E402,F401
from scenario_base import CASES, case, train  # noqa: E402,F401  (case, train: for scripts extending these scenarios)


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
