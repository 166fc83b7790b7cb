"""``nnx-es init | report | run | resume``: training from a spec file (:mod:`nnx_es.recipes.runspec`);
``report`` is :mod:`nnx_es.cli.report`, what the commands share :mod:`nnx_es.cli._specs`.

    nnx-es init --out spec.json [--dataset digits|breast_cancer|PATH.npz] [--model mlp] [--lr LR] [--epochs N] ...
    nnx-es report spec.json [--png lr.png] [--lr-find [--lr-find-png PATH] [--lr-find-steps N]] [--allow PKG]
    nnx-es run spec.json [--runs-dir runs] [--run-id ID] [--allow PKG]
    nnx-es resume runs/<id> [--spec spec.json] [--from last|best|SEQ] [--run-id ID] [--epochs N] [--allow PKG]

Exit status: 0 success, 1 the run failed, 2 bad input (one line on stderr naming what was wrong).
Every recipe is built by type for its slot (:mod:`nnx_es.recipes.slots`): a class of the slot's
base or a factory registered for it, from ``torch``, ``nnx_es`` and the packages ``--allow``
names; the spec file, or a stored run, cannot widen that. A stored spec is checked like a file
(and its ``spec_hash`` verified); arguments are checked before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from nnx_es.cli._common import EXIT_OK, EXIT_VIOLATIONS
from nnx_es.cli._specs import BadInput, allowed_packages, guarded, read_spec_file, runs_dir, say, stored_spec
from nnx_es.cli.report import report
from nnx_es.errors import ConfigError, LeaseHeldError, ResumeError, RunExistsError, UnsafePathError

__all__ = ["add_commands"]


def _init(args: argparse.Namespace) -> int:
    from nnx_es.recipes.runspec import scaffold

    out = Path(args.out)
    if out.exists() and not args.force:
        raise BadInput(f"--out {str(out)!r} already exists (pass --force to overwrite)")
    try:
        hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    except ValueError:
        raise BadInput(f"--hidden takes widths separated by commas (128,64), got {args.hidden!r}") from None
    spec = scaffold(dataset=args.dataset, model=args.model, lr=args.lr, epochs=args.epochs, seed=args.seed,
                    batch_size=args.batch_size, hidden=hidden, val_fraction=args.val_fraction)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n")
    print(f"wrote {out}: {args.model} on {args.dataset}, {args.epochs} epochs; next: nnx-es report {out}")
    return EXIT_OK


# --- report --------------------------------------------------------------------------------


def _train(built: Any, command: str, **fit: Any) -> int:
    try:
        run = built.trainer.fit(built.train_loader, built.val_loader, epochs=fit.pop("epochs", built.epochs), **fit)
    except RunExistsError as exc:  # said as the command line continues a run, not as fit(...) does
        raise BadInput(f"run {Path(exc.run_dir).name!r} already exists at {exc.run_dir}: continue it with nnx-es "
                       f"resume {exc.run_dir}, fork it with nnx-es resume {exc.run_dir} --from best|SEQ --run-id NEW, "
                       "or pass another --run-id") from None
    except (ConfigError, ResumeError, LeaseHeldError, UnsafePathError) as exc:  # refused before it began: exit 2
        raise BadInput(str(exc)) from None
    except Exception as exc:  # the run failed: it is recorded in its log
        say(command, f"the run failed: {type(exc).__name__}: {exc}")
        return EXIT_VIOLATIONS
    best = f", BEST epoch {run.best.epoch}" if run.best else ""
    print(f"run {run.run_id} {run.status}: {len(run.history)} epochs committed, {run.counters.step} updates{best}")
    print(f"  {run.run_dir}  (audit: nnx-replay {run.run_dir}; continue: nnx-es resume {run.run_dir})")
    return EXIT_OK if run.status in ("completed", "stopped") else EXIT_VIOLATIONS


def _run(args: argparse.Namespace) -> int:
    from nnx_es.recipes.runspec import build_run

    root = runs_dir(args)
    spec = read_spec_file(args.spec)
    built = build_run(spec, allowed=allowed_packages(args), runs_root=root, run_id=args.run_id)
    return _train(built, "run")


def _resume(args: argparse.Namespace) -> int:
    from nnx_es.recipes.runspec import build_run

    from nnx_es.argchecks import check_epochs

    if args.epochs is not None:
        check_epochs(args.epochs, "--epochs")
    run_dir = Path(args.run_dir).resolve()
    spec = read_spec_file(args.spec) if args.spec else stored_spec(run_dir)
    if spec is None:
        raise BadInput(f"run {run_dir.name!r} recorded no spec (it was not run with recipe_required): pass --spec")
    epochs = args.epochs if args.epochs is not None else spec.epochs
    allowed = allowed_packages(args)
    if args.from_ == "last":
        if args.run_id not in (None, run_dir.name):
            raise BadInput(f"--run-id {args.run_id!r}: resuming from LAST continues run {run_dir.name!r}; "
                           "--from best|SEQ forks a new run")
        built = build_run(spec, allowed=allowed, runs_root=run_dir.parent, run_id=run_dir.name)
        return _train(built, "resume", epochs=epochs, resume_from=run_dir)
    at: int | str = "best" if args.from_ == "best" else int(args.from_)
    run_id = args.run_id or f"{run_dir.name}-from-{at}"
    built = build_run(spec, allowed=allowed, runs_root=run_dir.parent, run_id=run_id)
    return _train(built, "resume", epochs=epochs, resume_from=run_dir, resume_mode="fork", resume_at=at)


def _from(text: str) -> str:
    if text in ("last", "best") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(f"--from takes 'last', 'best' or a LAST's seq, got {text!r}")


def add_commands(sub: Any) -> None:
    """Add ``init``, ``report``, ``run`` and ``resume`` to the ``nnx-es`` sub-parsers ``sub``."""
    allow = {"action": "append", "metavar": "PKG", "default": [],
             "help": "also allow recipes to import from package PKG (repeatable; default: torch, nnx_es)"}
    p = sub.add_parser("init", help="write a complete spec that runs as is",
                       description="Scaffold a spec: an MLP on a tabular data set, Adam, ReduceLROnPlateau, "
                       "EarlyStopping and BEST on val_loss.")
    p.add_argument("--out", required=True, help="the spec file to write (JSON)")
    p.add_argument("--dataset", default="digits", help="digits, breast_cancer or a .npz file with arrays x, y")
    p.add_argument("--model", default="mlp", help="mlp (default)")
    p.add_argument("--hidden", default="128", help="hidden widths, comma-separated (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    p.add_argument("--epochs", type=int, default=20, help="epoch budget (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size (default 32)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="rows held out for validation (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run and the split (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.set_defaults(run=guarded("init", _init))

    p = sub.add_parser("report", help="validate a spec, print its plan and warnings, preview its learning rate",
                       description="Validate SPEC without loading data: print optimizers, schedulers and their "
                       "clocks, callbacks, monitor and cadences, warn on common mistakes, and write a PNG of the "
                       "learning rate over the planned updates.")
    p.add_argument("spec", help="the spec file")
    p.add_argument("--png", default=None, help="where the preview goes (default: SPEC with .lr.png)")
    p.add_argument("--lr-find", action="store_true",
                   help="also run the learning-rate range test (a short exponential sweep of the spec's model, optimizer "
                        "and data in a throwaway run) and suggest a learning rate")
    p.add_argument("--lr-find-png", default=None, metavar="PATH", help="the range test's curve (default: SPEC with suffix .lr-find.png)")
    p.add_argument("--lr-find-steps", type=int, default=100, metavar="N", help="updates of the sweep (default 100)")
    p.add_argument("--allow", **allow)
    p.set_defaults(run=guarded("report", report))

    p = sub.add_parser("run", help="train the run a spec describes",
                       description="Build everything SPEC names (imports checked) and train; exit 0 when the run "
                       "completes or stops, 1 when it fails, 2 on bad input.")
    p.add_argument("spec", help="the spec file")
    p.add_argument("--runs-dir", default="runs", help="the runs root (default runs/)")
    p.add_argument("--run-id", default=None, help="the run id (default: a timestamp and a random suffix)")
    p.add_argument("--allow", **allow)
    p.set_defaults(run=guarded("run", _run))

    p = sub.add_parser("resume", help="continue a run, or fork a new one from an older checkpoint",
                       description="--from last (default) continues RUN_DIR from its LAST; --from best or a LAST's "
                       "seq forks a new run from that checkpoint's whole state (weights, optimizers, schedulers, RNG "
                       "streams, callback state; its epochs and counters from 0), recording its source (run id, LAST "
                       "seq, manifest hash); the source run is never written.")
    p.add_argument("run_dir", help="the run directory, runs/<id>")
    p.add_argument("--spec", default=None, help="the spec (default: the one the run recorded); it must be the "
                   "run's own but for epochs: any other difference is refused, named (a resume or a fork restores "
                   "the run's whole state, its optimizers' settings among it)")
    p.add_argument("--from", dest="from_", type=_from, default="last", help="last (default), best or SEQ")
    p.add_argument("--run-id", default=None, help="the new run's id with --from best|SEQ")
    p.add_argument("--epochs", type=int, default=None,
                   help="epoch budget (default: the spec's epochs). Resuming LAST: counted from the run's start, "
                        "so --epochs 30 on a 20-epoch run trains 10 more. A fork (--from best|SEQ): the new run's "
                        "own epochs, counted from 0 (its epoch 0 trains as the source's next epoch did)")
    p.add_argument("--allow", **allow)
    p.set_defaults(run=guarded("resume", _resume))
