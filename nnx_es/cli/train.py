"""``nnx-es init | report | run | resume``: training from a spec file (:mod:`nnx_es.recipes.runspec`).

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
import math
import sys
from pathlib import Path
from typing import Any

import msgspec

from nnx_es.artifacts import write_output
from nnx_es.cli._common import EXIT_OK, EXIT_UNUSABLE, EXIT_VIOLATIONS
from nnx_es.cli._format import printable
from nnx_es.errors import ConfigError, LeaseHeldError, NnxError, ResumeError, UnsafePathError

__all__ = ["BadInput", "add_commands", "allowed_packages", "guarded", "read_spec_file", "stored_spec"]

#: a learning rate outside this range is reported as unusual
LR_RANGE = (1e-6, 1.0)


class BadInput(Exception):
    """Exit 2 with this one-line message."""


def _say(command: str, exc: BaseException) -> None:
    print(printable(f"nnx-es {command}: {' '.join(str(exc).split())}"), file=sys.stderr)  # a spec's text, escaped


def allowed_packages(args: argparse.Namespace) -> Any:
    """The guard for ``--allow``: the user's own packages (never the standard library: ``--allow os`` would make
    ``os.popen`` a data factory; never torch or nnx_es, see :class:`~nnx_es.recipes.Allowed`).

    Raises BadInput when ``--allow`` names the standard library."""
    from nnx_es.recipes import Allowed

    stdlib = [p for p in args.allow or () if p.split(".")[0] in sys.stdlib_module_names]
    if stdlib:
        raise BadInput(f"--allow {stdlib[0]!r} is the standard library: --allow names your own package (its classes "
                       "are type-checked, its functions become factories)")
    if args.allow:
        _find_packages_beside(getattr(args, "spec", None))
    return Allowed(args.allow or ())


def _find_packages_beside(spec: str | None) -> None:
    """Let ``--allow``'s packages be found as ``python -m nnx_es`` finds them: in the working directory,
    and beside the spec file. The ``nnx-es`` console script's ``sys.path`` starts at its own ``bin/``, so
    without this a package next to the spec was "No module named ...". The directories go at the END of
    ``sys.path``: an installed package (torch) is never shadowed by a file there; the guard still type-checks
    everything imported from them."""
    for d in (Path.cwd(), Path(spec).resolve().parent if spec else None):
        if d is not None and str(d) not in sys.path:
            sys.path.append(str(d))


def read_spec_file(path: str) -> Any:
    """The spec at ``path`` (:func:`nnx_es.recipes.runspec.load_spec`: a regular JSON file of at most 16 MiB).

    Raises RecipeError naming the path when it is missing, not a regular file, too large or not a spec."""
    from nnx_es.recipes.runspec import load_spec

    return load_spec(path)


# --- init ----------------------------------------------------------------------------------


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


def _kw(recipe: Any) -> dict[str, Any]:
    return dict(recipe.kwargs) if recipe is not None else {}


def _short(target: Any) -> str:
    return str(target).rsplit(":", 1)[-1]


def _at(value: Any, *keys: str, default: Any = None) -> Any:
    """``value[k1][k2]...`` through mappings only; ``default`` where a key is missing or a step is no mapping
    (``report`` reads a spec's keywords before it builds them, so they may be anything JSON holds)."""
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def _groups(recipe: Any) -> list[dict[str, Any]] | None:
    """An optimizer recipe's listed parameter groups (``{"@params": [...]}``), the ones that are mappings; None: all."""
    listed = _at(recipe.kwargs, "params", "@params")
    return [g for g in listed if isinstance(g, dict)] if isinstance(listed, list) else None


def plan_warnings(spec: Any) -> list[str]:
    """The common mistakes ``report`` warns about, one line each."""
    warnings = []
    monitor = _kw(spec.monitor)
    data = _kw(spec.data)
    no_val = spec.data is None or (spec.data.target.endswith(":tabular") and not data.get("val_fraction", 0.2))
    if spec.monitor is not None and str(monitor.get("name", "")).startswith("val_") and no_val:
        warnings.append(f"monitor {monitor.get('name')!r} watches validation, but the data has no validation split")
    for s in spec.schedulers:
        inner = s.kwargs.get("scheduler")
        if str(_at(inner, "target", default="")).endswith("ReduceLROnPlateau"):
            mode = _at(inner, "kwargs", "mode", default="min")
            if spec.monitor is not None and mode != monitor.get("mode", "min"):
                warnings.append(f"scheduler {s.kwargs.get('name')!r}: ReduceLROnPlateau mode {mode!r} disagrees with "
                                f"the monitor's mode {monitor.get('mode', 'min')!r}")
            if spec.monitor is None:
                warnings.append(f"scheduler {s.kwargs.get('name')!r}: ReduceLROnPlateau without a monitor")
    for name, o in spec.optimizers.items():
        lrs = [o.kwargs.get("lr"), *(g.get("lr") for g in _groups(o) or [])]
        for lr in lrs:
            if isinstance(lr, (int, float)) and not LR_RANGE[0] <= lr <= LR_RANGE[1]:
                warnings.append(f"optimizer {name!r}: learning rate {lr:g} is far outside the usual range "
                                f"[{LR_RANGE[0]:g}, {LR_RANGE[1]:g}]")
    if "keep_last" in spec.trainer and spec.trainer["keep_last"] is None:
        warnings.append("no checkpoint retention: keep_last is null, so every checkpoint a LAST names is kept and "
                        "the run grows each epoch (set trainer.keep_last, e.g. 1)")
    if spec.trainer.get("phase_every") is not None and spec.trainer.get("keep_phases") is None:
        warnings.append("phase checkpoints are never rotated: keep_phases is unset")
    if spec.epochs < 1:
        warnings.append(f"epochs is {spec.epochs}: nothing will be trained")
    return warnings


def _updates_per_epoch(spec: Any) -> tuple[int, bool]:
    """(optimizer updates per epoch, whether that is known) -- from the data recipe's size, no loading."""
    from nnx_es.recipes.data import BUILTIN_DATASETS

    if spec.data is None or not spec.data.target.endswith("nnx_es.recipes.data:tabular"):
        return 1, False
    kw = _kw(spec.data)
    dataset = kw.get("dataset", "digits")
    rows = {"digits": 1797, "breast_cancer": 569}.get(dataset) if isinstance(dataset, str) else None
    if rows is None or dataset not in BUILTIN_DATASETS:
        return 1, False
    batch, fraction = kw.get("batch_size", 32), kw.get("val_fraction", 0.2)
    accumulation = next((h.kwargs.get("steps", 1) for h in spec.hooks if h.target.endswith(":GradientAccumulation")), 1)
    if not (_positive_int(batch) and _positive_int(accumulation) and isinstance(fraction, (int, float))
            and 0 <= fraction < 1):
        return 1, False  # what the run would refuse: drawn one per epoch
    train = rows - int(fraction * rows)
    return max(1, math.ceil(math.ceil(train / batch) / accumulation)), True


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


#: the most updates the learning-rate preview simulates (the rest of a longer plan is not drawn)
MAX_PREVIEW_UPDATES = 10_000


def lr_curve(spec: Any, allowed: Any) -> tuple[dict[str, list[float]], int]:
    """Each optimizer's first group's learning rate at every planned update (the first
    :data:`MAX_PREVIEW_UPDATES`), and updates per epoch.

    Builds the model, optimizers and schedulers (no data) by type, as a run would; a plateau
    scheduler is drawn as if the monitor improved every epoch (it never reduces).

    Raises:
        UnsafeRecipeError / RecipeError: see :func:`nnx_es.recipes.runspec.build_run`; RecipeError also when
            an optimizer or scheduler the spec builds fails a step of the preview (an LBFGS, which needs a
            closure; a OneCycleLR stepped past its ``total_steps``).
    """
    from nnx_es.errors import RecipeError
    from nnx_es.recipes import from_spec
    from nnx_es.recipes.runspec import build_model_and_optimizers

    _net, ctx, _ = build_model_and_optimizers(spec, allowed)
    schedulers = [from_spec(r, allowed=allowed, context=ctx, slot="scheduler") for r in spec.schedulers]
    per_epoch, _ = _updates_per_epoch(spec)
    curves: dict[str, list[float]] = {name: [] for name in ctx.optimizers}
    try:
        for _epoch in range(min(max(spec.epochs, 0), math.ceil(MAX_PREVIEW_UPDATES / per_epoch))):
            for _ in range(per_epoch):
                for name, opt in ctx.optimizers.items():
                    curves[name].append(float(opt.param_groups[0]["lr"]))
                    opt.step()
                for s in schedulers:
                    if getattr(s, "clock", "epoch") == "optimizer_update":
                        s.scheduler.step()
            for s in schedulers:
                if getattr(s, "clock", "epoch") == "epoch" and not getattr(s, "plateau", False):
                    s.scheduler.step()
    except Exception as exc:  # the spec's own optimizer or scheduler refusing its plan: the spec's fault, one line
        done = sum(map(len, curves.values())) // max(len(curves), 1)
        raise RecipeError(f"the learning-rate preview failed after {done} planned update(s): {type(exc).__name__}: "
                          f"{exc}; fix that optimizer or scheduler recipe") from None
    return curves, per_epoch


def _out(line: str) -> None:
    """Print one line of ``report``: a spec's strings (names, keywords) are someone else's text, escaped."""
    print(printable(line))


def _report(args: argparse.Namespace) -> int:
    spec = read_spec_file(args.spec)
    allowed = allowed_packages(args)
    from nnx_es.recipes.runspec import validate_spec

    validate_spec(spec, allowed)
    _out(f"spec {args.spec}: valid (imports allowed from {', '.join(allowed.prefixes)})")
    _out(f"model       {spec.model.target}  {_fmt(spec.model.kwargs)}")
    for name, o in spec.optimizers.items():
        listed = _groups(o)
        n = len(listed) if listed is not None else 1
        _out(f"optimizer   {name}: {_short(o.target)} lr={o.kwargs.get('lr', 'default')}, {n} parameter group(s)")
        if listed is not None and n > 1:  # layer-wise learning rates: each group's own
            base = o.kwargs.get("lr")
            for i, g in enumerate(listed):
                names = [str(n) for n in g.get("names", [])] if isinstance(g.get("names", []), list) else []
                _out(f"  group {i}   lr={g.get('lr', base)}  {len(names)} parameter(s): {', '.join(names[:4])}"
                      f"{', ...' if len(names) > 4 else ''}")
    for s in spec.schedulers:
        inner = s.kwargs.get("scheduler")
        inner_kw = {k: v for k, v in _at(inner, "kwargs", default={}).items() if k != "optimizer"} \
            if isinstance(_at(inner, "kwargs"), dict) else {}
        opt = _at(inner, "kwargs", "optimizer", "@optimizer", default="?")
        _out(f"scheduler   {s.kwargs.get('name')}: {_short(_at(inner, 'target', default='?'))} on {opt}, clock "
              f"{s.kwargs.get('clock', 'epoch')}  {_fmt(inner_kw)}")
    _out(f"loss        {_short(spec.loss.target)}  {_fmt(spec.loss.kwargs)}")
    for c in spec.callbacks:
        _out(f"callback    {_short(c.target)}  {_fmt(c.kwargs)}")
    for h in spec.hooks:
        _out(f"hook        {_short(h.target)}  {_fmt(h.kwargs)}")
    m = _kw(spec.monitor)
    _out(f"monitor     {m.get('name')} (mode {m.get('mode', 'min')}, min_delta {m.get('min_delta', 0.0)})"
          if spec.monitor else "monitor     none: no BEST, no plateau, no early stopping")
    t = spec.trainer
    _out(f"cadences    validate every {t.get('validate_every', 1)} epoch(s)"
          f"{', every %s updates' % t['validate_every_steps'] if t.get('validate_every_steps') else ''}; "
          f"phase every {t.get('phase_every')} epoch(s), keep {t.get('keep_phases')}; "
          f"checkpoint_lag {t.get('checkpoint_lag', 0)}")
    _out(f"run         {spec.epochs} epochs, seed {spec.seed}, metrics {spec.metrics}; data "
          f"{_short(spec.data.target) + ' ' + _fmt(spec.data.kwargs) if spec.data else 'none'}")
    for w in plan_warnings(spec):
        _out(f"warning: {w}")
    png = Path(args.png) if args.png else Path(args.spec).with_suffix(".lr.png")
    curves, per_epoch = lr_curve(spec, allowed)
    known = _updates_per_epoch(spec)[1]
    _plot(curves, png, per_epoch, known)
    drawn = sum(map(len, curves.values())) // max(len(curves), 1)
    _out(f"learning-rate preview: {png} ({drawn} planned updates{'' if drawn < MAX_PREVIEW_UPDATES else ' drawn'}, "
          f"{per_epoch} per epoch{'' if known else ' (unknown: one per epoch drawn)'})")
    if args.lr_find:
        _lr_find(spec, allowed, Path(args.lr_find_png) if args.lr_find_png else Path(args.spec).with_suffix(
            ".lr-find.png"), args.lr_find_steps)
    return EXIT_OK


def _lr_find(spec: Any, allowed: Any, png: Path, steps: int) -> None:
    """``report --lr-find``: the learning-rate range test (:func:`nnx_es.lr_find`) on the spec's model,
    optimizer, loss, update hooks and training data, in a throwaway run under a temporary runs root."""
    import tempfile

    from nnx_es.diagnostics.lr_range import lr_find
    from nnx_es.runtime.engine import default_forward
    from nnx_es.recipes.runspec import build_run

    if steps < 2:
        raise BadInput(f"--lr-find-steps takes an int >= 2, got {steps}")
    with tempfile.TemporaryDirectory(prefix="nnx-es-lr-find-") as root:  # build_run writes nothing; refused anyway
        built = build_run(spec, allowed=allowed, runs_root=root, run_id="lr-find", progress=False)
    trainer = built.trainer
    if len(trainer.optimizers) != 1:
        raise BadInput(f"--lr-find sweeps one optimizer; the spec has {len(trainer.optimizers)} "
                       f"({', '.join(trainer.optimizers)})")
    optimizer = next(iter(trainer.optimizers.values()))
    settings = {k: spec.trainer[k] for k in ("sample_weights", "device", "batch_gather") if k in spec.trainer}
    step_fn = trainer.engine.train_step_fn
    if step_fn is not default_forward and not settings.get("sample_weights"):
        settings["train_step_fn"] = step_fn
    result = lr_find(trainer.net, optimizer, trainer.objective, built.train_loader, hooks=list(trainer.update_hooks),
                     steps=steps, seed=spec.seed, plot=png, **settings)
    _out(str(result))
    _out(f"lr range test curve: {png}")


def _fmt(kwargs: dict[str, Any]) -> str:
    text = msgspec.json.encode({k: v for k, v in kwargs.items() if k != "params"}).decode()
    return text if len(text) < 120 else text[:117] + "..."


def _plot(curves: dict[str, list[float]], png: Path, per_epoch: int, known: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("the learning-rate preview needs matplotlib: pip install 'nnx_es[plots]'") from None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, lrs in curves.items():
        ax.plot(range(len(lrs)), lrs, label=name)
    ax.set_xlabel("optimizer update" + ("" if known else " (one per epoch: batches unknown)"))
    ax.set_ylabel("learning rate")
    ax.set_title(f"planned learning rate ({per_epoch} updates/epoch; plateau drawn as always improving)",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    write_output(png, fig.savefig)  # never into a run, no link followed
    plt.close(fig)


# --- run / resume ----------------------------------------------------------------------------


def _train(built: Any, command: str, **fit: Any) -> int:
    try:
        run = built.trainer.fit(built.train_loader, built.val_loader, epochs=fit.pop("epochs", built.epochs), **fit)
    except (ConfigError, ResumeError, LeaseHeldError, UnsafePathError) as exc:  # refused before it began: exit 2
        raise BadInput(str(exc)) from None
    except Exception as exc:  # the run failed: it is recorded in its log
        _say(command, f"the run failed: {type(exc).__name__}: {exc}")
        return EXIT_VIOLATIONS
    best = f", BEST epoch {run.best.epoch}" if run.best else ""
    print(f"run {run.run_id} {run.status}: {len(run.history)} epochs committed, {run.counters.step} updates{best}")
    print(f"  {run.run_dir}  (audit: nnx-replay {run.run_dir}; continue: nnx-es resume {run.run_dir})")
    return EXIT_OK if run.status in ("completed", "stopped") else EXIT_VIOLATIONS


def _run(args: argparse.Namespace) -> int:
    from nnx_es.recipes.runspec import build_run

    spec = read_spec_file(args.spec)
    built = build_run(spec, allowed=allowed_packages(args), runs_root=args.runs_dir, run_id=args.run_id)
    return _train(built, "run")


def stored_spec(run_dir: Path) -> Any:
    """The spec a run recorded in its ``run_started`` (None when it recorded none), its ``spec_hash``
    verified (:func:`nnx_es.recipes.runspec.spec_of_run`); the caller validates it like a file.

    Raises:
        BadInput: not a run directory, or a log that does not start with ``run_started``.
        RecipeError: the spec does not match its hash, or does not decode.
    """
    from events.log import LmdbLog
    from events.schema import RunStarted
    from nnx_es.recipes.runspec import spec_of_run

    if not (run_dir / "events.lmdb").is_dir():
        raise BadInput(f"{str(run_dir)!r} is not a run directory (no events.lmdb)")
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        first = next(iter(log.read()), None)
    if first is None or not isinstance(first[1], RunStarted):
        raise BadInput(f"{str(run_dir)!r}: its log does not start with run_started")
    return spec_of_run(first[1])


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


def _where_allowed_is_looked_for(args: argparse.Namespace, exc: BaseException) -> str:
    """For an ``--allow``'d module that does not import: where :func:`_find_packages_beside` looked, and what to do
    (a resume without ``--spec`` has no spec file: the working directory alone)."""
    missing = [p for p in getattr(args, "allow", None) or ()
               if f"No module named '{p.split('.')[0]}'" in str(exc)]
    if not missing:
        return ""
    spec = getattr(args, "spec", None)
    where = list(dict.fromkeys([str(Path.cwd())] + ([str(Path(spec).resolve().parent)] if spec else [])))
    return (f"; --allow {missing[0]!r} is looked for in the working directory" + (" and beside the spec file" if spec
            else "") + f" ({', '.join(where)}): run from the directory holding it, or put it on PYTHONPATH or install it")


def guarded(command: str, fn: Any) -> Any:
    """``fn(args)`` as a sub-command's ``run``: bad input (:class:`BadInput`, an ``NnxError``, an ``OSError``)
    is said in one line on stderr, exit 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (BadInput, NnxError, OSError) as exc:
            _say(command, BadInput(f"{exc}{_where_allowed_is_looked_for(args, exc)}"))
            return EXIT_UNUSABLE
    return run


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
    p.set_defaults(run=guarded("report", _report))

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
    p.add_argument("--spec", default=None, help="the spec (default: the one the run recorded)")
    p.add_argument("--from", dest="from_", type=_from, default="last", help="last (default), best or SEQ")
    p.add_argument("--run-id", default=None, help="the new run's id with --from best|SEQ")
    p.add_argument("--epochs", type=int, default=None,
                   help="epoch budget (default: the spec's epochs). Resuming LAST: counted from the run's start, "
                        "so --epochs 30 on a 20-epoch run trains 10 more. A fork (--from best|SEQ): the new run's "
                        "own epochs, counted from 0 (its epoch 0 trains as the source's next epoch did)")
    p.add_argument("--allow", **allow)
    p.set_defaults(run=guarded("resume", _resume))
