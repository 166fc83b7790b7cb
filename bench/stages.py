"""Where nnx_es's own microseconds go: a profile of a like-for-like run by stage.

``python -m bench.stages [--epochs 10]`` trains the overhead workload (digits MLP 64-128-10,
batch 32, Adam, ``batch_gather=False``, every microbatch evented, LAST each epoch) under
:mod:`cProfile` and sums each function's own time (``tottime``) by the stage its source file
belongs to (a built-in C function's time by the stage of the Python function that called it: a
``torch.stack`` in the engine is the engine's, a kernel under ``nn.Linear.forward`` is torch's). The stages that are nnx_es's own are the trainer's overhead; torch's forward,
backward and optimizer step and the DataLoader's fetch are the work every contender does.

The profile's clock is the training thread's CPU time (``time.thread_time``), the measure of
every ratio in ``bench/``: the durable commit's wait on the disk is not counted (it was, with
cProfile's default wall clock, and made the event log look like half of the overhead).
cProfile adds a fixed cost to every Python call, so the absolute microseconds are inflated
(most for the stages with the most small calls); the shares, and the calls per microbatch,
are what to read. Timings belong in ``bench/``, never in tests.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.overhead import digits_loader, make_net

__all__ = ["STAGES", "epoch_end_costs", "profile_by_stage", "stage_of"]

#: (stage, path fragments of the files whose functions it owns), first match wins
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("update engine (window, receipts, finiteness)", ("nnx_es/engine.py", "nnx_es/objective.py",
                                                     "nnx_es/metrics.py", "nnx_es/batches.py",
                                                     "nnx_es/update_hooks.py", "nnx_es/schedulers.py")),
    ("events (lifecycle machine, counters, recorder)", ("nnx_es/runtime/recording.py", "nnx_es/lifecycle.py",
                                                       "projections/", "transitions/")),
    ("event log (encode, LMDB append, sync)", ("events/",)),
    ("checkpoint and commit (capture, encode, LAST)", ("nnx_es/runtime/commit.py", "nnx_es/runtime/components.py",
                                                      "nnx_es/checkpoint.py", "nnx_es/storage.py",
                                                      "nnx_es/state_codec.py", "nnx_es/rng.py",
                                                      "nnx_es/retention.py", "nnx_es/runtime/finalize.py")),
    ("loop, context and callbacks", ("nnx_es/loop.py", "nnx_es/context.py", "nnx_es/callbacks.py",
                                     "nnx_es/stages.py", "nnx_es/runtime/run_state.py", "nnx_es/data.py",
                                     "nnx_es/device.py", "nnx_es/progress.py")),
    ("run start and finish (session, views)", ("nnx_es/",)),
    ("data loading (DataLoader, collate)", ("torch/utils/data",)),
    ("torch: forward, backward, optimizer step", ("torch/",)),
)


def stage_of(filename: str) -> str:
    """The stage that owns a function defined in ``filename`` ("other ...": none of :data:`STAGES`)."""
    for stage, fragments in STAGES:
        if any(f in filename for f in fragments):
            return stage
    return "other (the standard library and other packages, called from any stage)"


def profile_by_stage(epochs: int = 10) -> tuple[dict[str, tuple[float, int]], int]:
    """Run the workload under cProfile; return ``({stage: (seconds, calls)}, microbatches)``."""
    from nnx_es import Trainer

    torch.set_num_threads(1)
    _fit(Trainer, 1, profile=False)  # warm: lazy imports and first-call caches are not the steady state
    return _fit(Trainer, epochs, profile=True)


def _fit(Trainer: type, epochs: int, *, profile: bool) -> tuple[dict[str, tuple[float, int]], int]:
    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    root = Path(tempfile.mkdtemp(prefix="nnx_stages_"))
    try:
        trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id="stages", progress=False,
                          batch_gather=False)
        prof = cProfile.Profile(time.thread_time)  # CPU time: a synced commit's wait on the disk is no one's cost
        if profile:
            prof.enable()
        trainer.fit(loader, epochs=epochs)
        prof.disable()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    totals: dict[str, tuple[float, int]] = {}
    if not profile:
        return totals, 0

    def add(stage: str, seconds: float, calls: int) -> None:
        t, n = totals.get(stage, (0.0, 0))
        totals[stage] = (t + seconds, n + calls)

    for (filename, _line, _name), (_cc, ncalls, tottime, _ct, callers) in pstats.Stats(prof).stats.items():
        if filename == "~" and callers:  # a built-in (a C function): its time is its callers' stage's
            for (caller_file, _l, _n), (_ccc, calls, seconds, _cum) in callers.items():
                add(stage_of(caller_file), seconds, calls)
        else:
            add(stage_of(filename), tottime, ncalls)
    return totals, epochs * len(loader)


def epoch_end_costs(epochs: int = 10, runs: int = 3) -> dict[str, float]:
    """CPU ms (``thread_time``, medians over every epoch of ``runs`` fits, no profiler) of each
    epoch's end on the training thread: ``"epoch end"`` (summary, decision, history and the
    commit), ``"commit"`` (capture, encode, LAST and its group, the one synced write) and
    ``"capture"``; and ``"fixed"``, a run's CPU ms outside its epochs (opening, the initial
    and final commits, finalization, the views)."""
    import statistics
    import time

    from nnx_es import Trainer
    from nnx_es.runtime.commit import Committer
    from nnx_es.runtime.loop import TrainingLoop
    from nnx_es.runtime import commit as commit_module

    torch.set_num_threads(1)
    seen: dict[str, list[float]] = {"epoch end": [], "commit": [], "capture": [], "epoch": [], "fit": []}
    originals = [(TrainingLoop, "_close_epoch", "epoch end"), (Committer, "submit", "commit"),
                 (commit_module, "capture", "capture"), (TrainingLoop, "_epoch", "epoch"), (Trainer, "fit", "fit")]

    def timed(f, label):  # noqa: ANN001, ANN202
        def g(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                seen[label].append(time.thread_time() - t0)
        return g

    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in originals]
    try:
        for owner, name, label in originals:
            setattr(owner, name, timed(getattr(owner, name), label))
        _fit(Trainer, 1, profile=False)
        for v in seen.values():
            v.clear()
        for _ in range(runs):
            _fit(Trainer, epochs, profile=False)
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    # the initial and final commits are among seen["commit"] (2 of 12 a run): the median is an epoch's
    fixed = statistics.median([seen["fit"][i] - sum(seen["epoch"][i * epochs:(i + 1) * epochs])
                               for i in range(runs)])
    return {"epoch end": statistics.median(seen["epoch end"]) * 1e3,
            "commit": statistics.median(seen["commit"]) * 1e3,
            "capture": statistics.median(seen["capture"]) * 1e3, "fixed": fixed * 1e3}


def table(totals: dict[str, tuple[float, int]], microbatches: int) -> list[str]:
    """Markdown rows: stage, µs per microbatch (under cProfile), share of nnx_es's own, calls per microbatch."""
    own = {s: v for s, v in totals.items() if not s.startswith(("torch", "data", "other"))}
    own_s = sum(t for t, _ in own.values()) or 1.0
    lines = ["| stage | µs per microbatch (profiled) | share of nnx_es's own | calls per microbatch |",
             "|---|---|---|---|"]
    for stage, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        share = f"{t / own_s:.0%}" if stage in own else "(not ours)"
        lines.append(f"| {stage} | {t / microbatches * 1e6:.1f} | {share} | {n / microbatches:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="profile nnx_es's own overhead by stage")
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args(argv)
    totals, microbatches = profile_by_stage(args.epochs)
    print("\n".join(table(totals, microbatches)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
