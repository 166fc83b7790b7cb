"""Python calls, C calls and aten ops per microbatch per rank that nnx_es DDP adds to the hand DDP loop.

``python -m bench.ddp_calls [--top 30]`` starts one ``torchrun --nproc-per-node=2`` launch (gloo,
CPU, one torch thread a rank; the workload of :mod:`bench.ddp`) whose ranks each run
``nnx_es DDP, batch_gather=False`` and the hand loop with the host-staged agreement
(``run_hand(..., save=True, agree="host")``, bench.ddp's ``HAND_HOST``) for 2 and then 4 epochs,
counting every Python function call and C call (``sys.setprofile``, as :mod:`bench.calls`) and
every aten op (a ``TorchDispatchMode`` counter: forward, backward, the optimizer, the collectives
that reach the dispatcher). Per microbatch in steady state = (4-epoch count - 2-epoch count) over
the 58 microbatches between (29 a rank an epoch): the fixed start and finish cancel, each epoch's
end is spread over its microbatches. Rank 0 prints, for each rank, the totals of the hand loop and
what nnx_es adds, then the largest differences by function and by op.

A count does not move with the load of a shared machine, so a change to the DDP hot path can be
judged by it; a call is not a fixed cost (a kernel launch is dearer than ``len``), so read it beside
the CPU-time ratio of :mod:`bench.ddp`. ``--callers`` keys every call by its caller too (where a
C call such as ``isinstance`` comes from); ``--json FILE`` writes the per-rank differences.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.calls import _where, count_calls
from bench.ddp import _dataset, _loader, run_hand, run_nnx, run_on_two_ranks

__all__ = ["count_callers", "count_ops", "main"]

SHORT, LONG = 2, 4


def count_callers(fn: Callable[[], Any]) -> Counter[tuple[str, str]]:
    """:func:`bench.calls.count_calls` with each call keyed by its caller too (``--callers``)."""
    return count_calls(fn, callers=True)


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    """``{aten op: calls}`` dispatched while ``fn`` runs (a ``TorchDispatchMode`` on this thread)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter[str] = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return ops


def _contenders() -> dict[str, Callable[[Any, int, Path], int]]:
    return {"hand": lambda d, e, r: run_hand(d, e, r, save=True, agree="host"), "nnx": run_nnx}


def _one(fn: Callable[[Any, int, Path], int], dataset: Any, epochs: int,
         counter: Callable[[Callable[[], Any]], Counter[Any]]) -> Counter[Any]:
    import torch.distributed as dist

    root = Path(tempfile.mkdtemp(prefix=f"ddp_calls_r{dist.get_rank()}_"))
    try:
        dist.barrier()
        return counter(lambda: fn(dataset, epochs, root))
    finally:
        dist.barrier()
        shutil.rmtree(root, ignore_errors=True)


def worker(out: str, callers: bool = False) -> int:
    """One rank: count each contender for SHORT and LONG epochs; rank 0 writes both ranks' differences."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    dataset = _dataset()
    microbatches = len(_loader(dataset)) * (LONG - SHORT)
    for fn in _contenders().values():  # warm: lazy imports and first-call caches are not the steady state
        _one(fn, dataset, 1, count_calls)
    mine: dict[str, Any] = {}
    for kind, counter in (("calls", count_callers if callers else count_calls), ("ops", count_ops)):
        per: dict[str, dict[Any, float]] = {}
        for name, fn in _contenders().items():
            short, long = _one(fn, dataset, SHORT, counter), _one(fn, dataset, LONG, counter)
            per[name] = {k: (long[k] - short[k]) / microbatches for k in set(long) | set(short)}
        keys = set(per["hand"]) | set(per["nnx"])
        extra = {k: per["nnx"].get(k, 0.0) - per["hand"].get(k, 0.0) for k in keys}
        mine[kind] = {"hand": sum(per["hand"].values()), "nnx": sum(per["nnx"].values()),
                      "extra": [[list(k) if isinstance(k, tuple) else [k], v] for k, v in extra.items() if v]}
        if kind == "calls":
            for name in ("hand", "nnx"):
                mine[kind][f"{name}_py"] = sum(v for k, v in per[name].items() if k[0] != "C")
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(both))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(callers: bool = False, timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Start the 2-rank launch and return every rank's counts."""
    return run_on_two_ranks("bench.ddp_calls", ["--callers"] if callers else [], timeout_s)  # type: ignore[no-any-return]


def report(ranks: list[dict[str, Any]], top: int) -> str:
    lines = ["| per microbatch | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " |",
             "|---|" + "---|" * len(ranks)]

    def row(label: str, f: Callable[[dict[str, Any]], float]) -> None:
        lines.append(f"| {label} | " + " | ".join(f"{f(r):.2f}" for r in ranks) + " |")

    row("hand (host agreement): calls", lambda r: r["calls"]["hand"])
    row("nnx_es adds: calls", lambda r: r["calls"]["nnx"] - r["calls"]["hand"])
    row("  of which Python", lambda r: r["calls"]["nnx_py"] - r["calls"]["hand_py"])
    row("  of which C", lambda r: (r["calls"]["nnx"] - r["calls"]["nnx_py"])
        - (r["calls"]["hand"] - r["calls"]["hand_py"]))
    row("hand (host agreement): aten ops", lambda r: r["ops"]["hand"])
    row("nnx_es adds: aten ops", lambda r: r["ops"]["nnx"] - r["ops"]["hand"])
    for rank, r in enumerate(ranks):
        for kind in ("calls", "ops"):
            lines += ["", f"rank {rank}, {kind} nnx_es adds, by {'function' if kind == 'calls' else 'op'}:"]
            for k, v in sorted(r[kind]["extra"], key=lambda kv: -abs(kv[1]))[:top]:
                name = f"{_where(k[0])}:{k[1]}" if kind == "calls" else k[0]
                lines.append(f"{v:8.2f}  {name}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="calls and aten ops per microbatch nnx_es DDP adds to the hand loop")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path, help="write both ranks' counts here")
    ap.add_argument("--callers", action="store_true", help="key each call by its caller too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.out, args.callers)
    ranks = launch(args.callers)
    if args.json:
        args.json.write_text(json.dumps(ranks))
    print(report(ranks, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
