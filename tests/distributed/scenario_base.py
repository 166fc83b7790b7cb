"""The scenarios' registry and shared set-ups: :data:`CASES`, the :func:`case` decorator, :func:`train`
(the reference DDP fit of :mod:`ddpkit`) and :func:`error` (an exception as a test compares it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nnx_es.runtime.run_state import World  # noqa: E402

torch.set_num_threads(1)

Case = Callable[[World, Path], dict[str, Any]]
#: every case, by name (filled as the case modules are imported: scenarios.py imports them all)
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn



def train(world: World, out: Path, run_id: str, epochs: int = 2, runs_root: Path | None = None,
          fit: dict[str, Any] | None = None, **kw: Any) -> tuple[Any, Any, Any]:
    import ddpkit
    from nnx_es.distributed import DDP, train_loader

    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=runs_root or out / "runs", run_id=run_id,
                       distributed=DDP(timeout_seconds=30), **kw)
    loader = train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED)
    result = t.fit(loader, epochs=epochs, **(fit or {}))
    return model, t, result


def error(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc), *[c.__name__ for c in type(exc).__mro__]]
