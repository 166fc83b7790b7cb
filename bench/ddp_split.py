"""Where nnx_es DDP's CPU beyond the floor goes: per fit or per epoch, the training thread or gloo's.

``python -m bench.ddp_split [--reps 6] [--epochs 2 10]`` starts one ``torchrun --nproc-per-node=2``
launch (gloo, CPU, one torch thread a rank; the workload of :mod:`bench.ddp`) whose ranks alternate
the floor (``bench.ddp``'s ``FLOOR``: the hand DDP loop with the host-staged agreement and the
records the target requires) and ``nnx_es DDP, batch_gather=False``, at each epoch count, ``--reps``
times. For each contender it takes the process's CPU time (every thread: the training thread and
gloo's), the training thread's own (``time.thread_time``), and inside it the epoch ends: nnx_es's
``_close_epoch`` and the digest's ``at_epoch_end``; the floor's checkpoint (``encode_state``,
``encode_checkpoint``, the synced ``LmdbLog.flush``).

Two epoch counts separate what a fit pays once (set-up, the opening and final commits, the
group's agreements around them) from what each epoch pays: ``excess(E) = fixed + E * per_epoch``
(least squares over the medians), nnx_es minus the floor, per rank. The per-epoch part is split
into the training thread's epoch end, its microbatches (the rest of the training thread; per
microbatch: over the 29 of a rank's epoch) and the other threads (gloo's work on the collectives).

Medians of the reps; the pairing (alternation within one launch) cancels most of a shared
machine's drift, not all. Timings belong here, never in tests.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ddp import _dataset, _loader, _timed, run_hand, run_nnx, run_on_two_ranks

__all__ = ["fit_line", "main"]

CONTENDERS = ("floor", "nnx_es")


def _timing(acc: Counter[str], key: str, owner: Any, name: str) -> None:
    """Add the training thread's time inside ``owner.name`` to ``acc[key]`` (a wrapper, this process only)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.thread_time() - t0

    setattr(owner, name, timed)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import nnx_es.checkpoint
    import nnx_es.state_codec
    from events.log import LmdbLog
    from nnx_es.distributed.digest import ParamDigest
    from nnx_es.runtime.loop import TrainingLoop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    acc: Counter[str] = Counter()
    _timing(acc, "end", TrainingLoop, "_close_epoch")
    _timing(acc, "end", ParamDigest, "at_epoch_end")
    for owner, name in ((nnx_es.state_codec, "encode_state"), (nnx_es.checkpoint, "encode_checkpoint")):
        _timing(acc, "floor_end", owner, name)  # imported by run_hand at each call: the wrapped ones
    flush = LmdbLog.flush

    def synced(self: LmdbLog, *, sync: bool = False) -> None:
        t0 = time.thread_time()
        try:
            flush(self, sync=sync)
        finally:
            if sync:
                acc["floor_end"] += time.thread_time() - t0

    LmdbLog.flush = synced  # type: ignore[method-assign]
    dataset = _dataset()
    fns: dict[str, Callable[[Any, int, Path], int]] = {
        "floor": lambda d, e, r: run_hand(d, e, r, agree="host", records=True),
        "nnx_es": run_nnx,
    }
    for fn in fns.values():
        _timed(fn, dataset, 1)  # warm-up
    rows: dict[str, list[dict[str, float]]] = {f"{name}@{e}": [] for e in args.epochs for name in fns}
    for _ in range(args.reps):
        for epochs in args.epochs:
            for name, fn in fns.items():
                acc.clear()
                t0 = time.thread_time()
                r = _timed(fn, dataset, epochs)
                main_s = time.thread_time() - t0
                end = acc["end"] if name == "nnx_es" else acc["floor_end"]
                rows[f"{name}@{epochs}"].append({"process": r["cpu"], "main": main_s, "end": end})
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, rows)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"ranks": both, "batches": len(_loader(dataset))}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` through ``points`` ``(x, y)``; returns ``(a, b)``.

    Raises:
        ValueError: fewer than two distinct x.
    """
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct epoch counts, got {sorted(set(xs))}")
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def report(result: dict[str, Any], epochs: list[int], reps: int) -> str:
    batches = result["batches"]
    lines = [f"nnx_es DDP (batch_gather=False) over the floor, per rank: {reps} reps alternated at {epochs} epochs "
             f"({batches} microbatches a rank an epoch); ms of CPU, medians", "",
             "| rank | what | per fit | per epoch | per microbatch (us) |", "|---|---|---|---|---|"]
    for rank, rows in enumerate(result["ranks"]):
        def excess(key: str) -> tuple[float, float]:
            pts = [(e, 1e3 * (statistics.median(r[key] for r in rows[f"nnx_es@{e}"])
                              - statistics.median(r[key] for r in rows[f"floor@{e}"]))) for e in epochs]
            return fit_line(pts)
        proc, main_, end = excess("process"), excess("main"), excess("end")
        parts = [("all threads", proc), ("the training thread", main_), ("  its epoch ends", end),
                 ("  its microbatches", (main_[0] - end[0], main_[1] - end[1])),
                 ("other threads (gloo)", (proc[0] - main_[0], proc[1] - main_[1]))]
        for what, (fixed, per_epoch) in parts:
            lines.append(f"| {rank} | {what} | {fixed:+.1f} | {per_epoch:+.2f} | {1e3 * per_epoch / batches:+.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="nnx_es DDP's CPU beyond the floor, split by where it is spent")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--epochs", type=int, nargs="+", default=[2, 10], help="two or more epoch counts (default 2 10)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if len(set(args.epochs)) < 2 or min(args.epochs) < 1:
        ap.error(f"--epochs takes two or more distinct counts >= 1, got {args.epochs}")
    if args.worker:
        return worker(args)
    result = run_on_two_ranks("bench.ddp_split", ["--reps", str(args.reps), "--epochs", *map(str, args.epochs)])
    print(report(result, args.epochs, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
