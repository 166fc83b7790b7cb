"""Python and C calls per microbatch that nnx_es adds to the hand loop: a deterministic measure.

``python -m bench.calls [--top 40]`` runs the overhead workload (digits MLP 64-128-10, batch 32,
Adam, ``batch_gather=False``: like for like) and the hand-written loop under ``sys.setprofile``,
each for 2 and then 4 epochs, and prints, per microbatch in steady state (the 4-epoch count
minus the 2-epoch count, over the 114 microbatches between: the run's fixed start and finish
cancel, each epoch's end is spread over its 57 microbatches), how many more Python function
calls and C calls nnx_es makes than the hand loop, by function. Unlike a time, a call count
does not move with the load of a shared machine, so a change to the hot path can be judged
by it; a call is not a fixed cost (a kernel launch is dearer than ``len``), so read it beside
the CPU-time ratio of ``bench.run`` and the stage table of ``bench.stages``.

``--callers`` keys each function by its caller too (``"function <- caller's file:function"``): who
makes the extra calls.

``python -m bench.calls --side-by-side`` prints, from one run, the calls per microbatch of nnx_es
(like for like), the hand loop, the durable hand loop (an atomic ``torch.save`` each epoch) and
Ignite with ``Checkpoint`` (when installed: the bench venv, ``make .venv-bench/.installed``), each
against the hand loop, and the CPU-time ratio of each to the hand loop measured in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch
from torch import nn

from bench.overhead import digits_loader, make_net

__all__ = ["count_calls", "extra_calls"]


def _hand(epochs: int) -> Callable[[], None]:
    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def go() -> None:
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
    return go


def _nnx(epochs: int) -> Callable[[], None]:
    from nnx_es import Trainer

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    root = Path(tempfile.mkdtemp(prefix="nnx_calls_"))
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id="calls", progress=False,
                      batch_gather=False)

    def go() -> None:
        try:
            trainer.fit(loader, epochs=epochs)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return go


_ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def _where(filename: str) -> str:
    return filename.split("site-packages/")[-1].replace(_ROOT, "")


def count_calls(fn: Callable[[], None], *, callers: bool = False) -> Counter[tuple[str, str]]:
    """``{(file or "C", function): calls}`` made while ``fn`` runs (``sys.setprofile``); with
    ``callers`` each call is keyed by its caller too: ``"function <- caller's file:function"``."""
    calls: Counter[tuple[str, str]] = Counter()

    def profile(frame, event, arg):  # noqa: ANN001 - the sys.setprofile signature
        if event == "call":
            name = frame.f_code.co_name
            if callers:
                back = frame.f_back
                name += f" <- {_where(back.f_code.co_filename)}:{back.f_code.co_name}" if back is not None else " <- ?"
            calls[(frame.f_code.co_filename, name)] += 1
        elif event == "c_call":
            name = getattr(arg, "__qualname__", repr(arg))
            if callers:
                name += f" <- {_where(frame.f_code.co_filename)}:{frame.f_code.co_name}"
            calls[("C", name)] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def extra_calls(short: int = 2, long: int = 4, *, callers: bool = False) -> tuple[dict[tuple[str, str], float], float]:
    """``({(file, function): extra calls per microbatch}, the hand loop's calls per microbatch)``;
    ``callers``: each function keyed by its caller too (:func:`count_calls`)."""
    torch.set_num_threads(1)
    _nnx(1)()  # warm: lazy imports and first-call caches are not the steady state
    _hand(1)()
    a_short, a_long = count_calls(_nnx(short), callers=callers), count_calls(_nnx(long), callers=callers)
    h_short, h_long = count_calls(_hand(short), callers=callers), count_calls(_hand(long), callers=callers)
    microbatches = len(digits_loader()) * (long - short)
    extra = {k: ((a_long[k] - a_short[k]) - (h_long[k] - h_short[k])) / microbatches
             for k in set(a_long) | set(h_long)}
    hand = (sum(h_long.values()) - sum(h_short.values())) / microbatches
    return {k: v for k, v in extra.items() if v}, hand


def _timed(run: Callable[[int], Any], epochs: int) -> Callable[[], None]:
    return lambda: run(epochs)  # noqa: E731 - a workload of bench.overhead (its setup counted in both runs: it cancels)


def _workloads() -> dict[str, Callable[[int], Callable[[], None]]]:
    """Name -> ``epochs -> zero-argument run``: nnx_es like for like, the hand loop, the durable hand
    loop (an atomic ``torch.save`` each epoch) and, when installed, Ignite with ``Checkpoint``."""
    from bench import overhead

    out: dict[str, Callable[[int], Callable[[], None]]] = {
        "nnx_es": _nnx, "hand loop": _hand,
        "durable hand loop": lambda e: _timed(overhead.run_hand_durable, e),
    }
    try:
        import ignite  # noqa: F401
    except ImportError:
        pass
    else:
        out["Ignite + Checkpoint"] = lambda e: _timed(overhead.run_ignite_durable, e)
    return out


def side_by_side(short: int = 2, long: int = 4, repeats: int = 3) -> list[tuple[str, float, float]]:
    """``[(workload, calls per microbatch, CPU-time ratio to the hand loop)]``: the calls as
    :func:`extra_calls` counts them (steady state, deterministic); the ratio of the medians of
    ``repeats`` interleaved ``long``-epoch runs' CPU time (``time.process_time``), from this run."""
    import statistics
    import time

    torch.set_num_threads(1)
    work = _workloads()
    microbatches = len(digits_loader()) * (long - short)
    calls: dict[str, float] = {}
    for name, make in work.items():
        make(1)()  # warm: lazy imports and first-call caches
        a, b = count_calls(make(short)), count_calls(make(long))
        calls[name] = (sum(b.values()) - sum(a.values())) / microbatches
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(repeats):
        for name, make in work.items():
            run = make(long)
            t0 = time.process_time()
            run()
            times[name].append(time.process_time() - t0)
    hand = statistics.median(times["hand loop"])
    return [(name, calls[name], statistics.median(times[name]) / hand) for name in work]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="calls per microbatch nnx_es adds to the hand loop")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--callers", action="store_true", help="each function keyed by its caller too")
    ap.add_argument("--side-by-side", action="store_true",
                    help="nnx_es, the hand loop, the durable hand loop and Ignite + Checkpoint: calls and time ratios")
    args = ap.parse_args(argv)
    if args.side_by_side:
        rows = side_by_side()
        hand = dict((n, c) for n, c, _ in rows)["hand loop"]
        print(f"{'workload':<22}{'calls/microbatch':>18}{'vs hand loop':>14}{'CPU time ratio':>16}")
        for name, calls, ratio in rows:
            print(f"{name:<22}{calls:>18.1f}{calls - hand:>+14.1f}{ratio:>15.2f}x")
        return 0
    extra, hand = extra_calls(callers=args.callers)
    py = sum(v for (f, _), v in extra.items() if f != "C")
    c = sum(v for (f, _), v in extra.items() if f == "C")
    print(f"calls per microbatch: the hand loop {hand:.1f}; nnx_es adds {py + c:.1f} ({py:.1f} Python, {c:.1f} C)")
    for (f, name), v in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
        print(f"{v:8.2f}  {_where(f)}:{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
