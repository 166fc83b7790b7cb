"""``nnx-es report spec.json``: what a spec will do, worked out before anything trains -- the spec
checked as ``run`` checks it (no data read), each part named, the common mistakes warned about, the
learning-rate curve drawn (``--png``), and with ``--lr-find`` a learning-rate range test.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import msgspec

from nnx_es.artifacts import write_output
from nnx_es.cli._common import EXIT_OK
from nnx_es.cli._format import printable
from nnx_es.cli._specs import BadInput, allowed_packages, read_spec_file

__all__ = ["lr_curve", "plan_warnings", "report"]

#: a learning rate outside this range is reported as unusual
LR_RANGE = (1e-6, 1.0)


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


def report(args: argparse.Namespace) -> int:
    spec = read_spec_file(args.spec)
    allowed = allowed_packages(args)
    from nnx_es.recipes.runspec import build_model_and_optimizers, check_spec_metrics, validate_spec

    validate_spec(spec, allowed)
    check_spec_metrics(spec, allowed, *build_model_and_optimizers(spec, allowed)[:2])  # as a run checks them
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
