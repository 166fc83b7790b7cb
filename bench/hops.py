"""Calls from one of the project's files into another, per microbatch: how far a microbatch walks.

``python -m bench.hops`` runs the workload of :mod:`bench.calls` (digits MLP 64-128-10, batch 32,
Adam, ``batch_gather=False``, every microbatch evented, LAST each epoch), with each epoch
validated on 256 rows, for 2 and then 4 epochs
under ``sys.setprofile`` and prints, per microbatch in steady state (the 4-epoch count minus the
2-epoch count, over the 114 microbatches between), every call from a file of the project
(``nnx_es/``, ``events/``, ``projections/``) into another of its files, the files visited, and
how many of those calls went **back up**: into a file that was already on the call stack (a
callee calling its caller's module again). Calls into torch and the standard library are not
counted; a key's count includes its calls at an epoch's end, spread over the epoch's 57
microbatches (``emit``'s folds show 2.12, not 2: seven epoch-level events), and a key rarer than
``--min`` (default 0.5) a microbatch is left out -- except calls back up, which are listed however
rare (an epoch's validation and commit included). ``--min 0`` gives every call of a steady-state
epoch, amortized. What it cannot see: a call whose immediate caller is not the project's (through a
torch decorator, ``contextlib`` or structlog), and other threads (the commit thread of
``checkpoint_lag > 0``). The workload sets ``batch_gather=False``, so a batch is moved by
``device.move_batch`` where the default gathers it (``data._gathered``).

Like :mod:`bench.calls` this is a count, not a time: it does not move with the machine's load.
It answers issue 29's "a microbatch walks N files in M hops" the same way on any commit (the
script needs only ``nnx_es.Trainer`` and :mod:`bench.overhead`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.overhead import digits_loader, make_net

__all__ = ["hops"]

_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
_PACKAGES = tuple(_ROOT + p + "/" for p in ("nnx_es", "events", "projections"))


def _run(epochs: int) -> Callable[[], None]:
    from nnx_es import Trainer

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    root = Path(tempfile.mkdtemp(prefix="nnx_hops_"))
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id="hops", progress=False,
                      batch_gather=False)

    x, y = loader.dataset.tensors  # type: ignore[attr-defined]
    val = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=128)  # each epoch validated: its calls counted too

    def go() -> None:
        try:
            trainer.fit(loader, val, epochs=epochs)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return go


def _count(fn: Callable[[], None]) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """(every cross-file call as (caller file, callee file:function), those back up into a file on the stack)."""
    calls: Counter[tuple[str, str]] = Counter()
    back: Counter[tuple[str, str]] = Counter()

    def profile(frame, event, arg):  # noqa: ANN001 - the sys.setprofile signature
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller_frame = frame.f_back
        if caller_frame is None or not callee.startswith(_PACKAGES):
            return
        caller = caller_frame.f_code.co_filename
        if caller == callee or not caller.startswith(_PACKAGES):
            return
        key = (caller[len(_ROOT):], f"{callee[len(_ROOT):]}:{frame.f_code.co_name}")
        calls[key] += 1
        up = caller_frame.f_back
        while up is not None:  # the callee's file already on the stack: a call back up
            if up.f_code.co_filename == callee:
                back[key] += 1
                break
            up = up.f_back

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, back


def hops(short: int = 2, long: int = 4, minimum: float = 0.5) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """``({(caller file, callee file:function): calls per microbatch}, {the same, back up only})``
    in steady state: the calls each at least ``minimum``, the calls back up however rare (an epoch's
    end included)."""
    torch.set_num_threads(1)
    _run(1)()  # warm: lazy imports and first-call caches are not the steady state
    (a, a_back), (b, b_back) = _count(_run(short)), _count(_run(long))
    n = len(digits_loader()) * (long - short)

    def per(x: Counter[tuple[str, str]], y: Counter[tuple[str, str]], least: float) -> dict[tuple[str, str], float]:
        out = {k: (y[k] - x[k]) / n for k in set(x) | set(y)}
        return {k: v for k, v in sorted(out.items()) if v > 0 and v >= least}
    return per(a, b, minimum), per(a_back, b_back, 1 / n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=float, default=0.5, help="leave out calls rarer than this per microbatch")
    args = parser.parse_args(argv)
    calls, back = hops(minimum=args.min)
    files = sorted({f for caller, callee in calls for f in (caller, callee.split(":")[0])})
    for (caller, callee), v in calls.items():
        print(f"{v:6.2f}  {caller} -> {callee}")
    print(f"\none microbatch: {sum(calls.values()):.2f} calls between files, {len(files)} files; "
          f"calls back up into a file on the stack, an epoch's end included: {sum(back.values()):.3f}")
    for (caller, callee), v in back.items():
        print(f"  back up: {v:6.2f}  {caller} -> {callee}")
    print("files:", " ".join(files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
