"""Every rank runs the same recipe: the ranks compare what each declares before training.

Data parallelism is correct only when every rank trains the same thing: the same loss and its
arguments, optimizers and their hyperparameters, schedulers, window, precision and clipping,
callbacks that run on every rank, epochs, data. Each rank builds its own trainer, so a setting
read from the environment, a branch on the rank, or a different file on another host makes one
rank train something else; the gradients of two different objectives are then averaged and the
run completes on them (or one rank ends its epochs early and the other hangs until the group's
timeout). No peer trainer checks this; the divergence digest (:mod:`nnx_es.distributed.digest`)
sees it only in the weights, and only for what moves them.

:func:`check_alike` gathers each rank's declaration once (one all-gather) and refuses, on every
rank alike, a field that differs, naming it and each rank's value. Only what differs between
ranks by design is left out: the callbacks that run on the writer alone, a rank's own shard
of the validation rows (its length), the library versions and the ``recipe`` metadata (they
are compared and a difference is logged: hosts may differ in a patch release or a data path).

What is compared of an object of torch's or nnx_es's is its settings (:func:`settings`: public
numbers, strings, flags, small tensors: a ``Dropout``'s ``p``, a scheduler's ``gamma``); of a
function its name, defaults and a ``functools.partial``'s arguments (:func:`describe_callable`);
of a data set a fingerprint of 8 rows (:func:`data_fingerprint`). Not compared, since they
legitimately differ per process (a start time, a process id, a scratch directory, a count of
its own validation batches): the attributes of your own classes (modules, losses, callbacks,
hooks: compared by class name) and the values a function's closure captured -- a per-rank
setting kept there goes unseen, as do rows the fingerprint does not sample.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from nnx_es.errors import ConfigError
from nnx_es.loaders import loader_geometries

if TYPE_CHECKING:
    from events.schema import RunStarted

__all__ = ["check_alike", "check_trainer_alike", "data_fingerprint", "declaration", "describe_callable", "settings"]

log = structlog.get_logger("nnx_es.distributed")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs per process, not per recipe
_DEVICE = re.compile(r"\b(cuda|xpu|npu|hpu|mps):\d+\b")  # so does a device's index: each rank has its own
#: attributes that differ by design: the mode the loop sets itself
_NOT_SETTINGS = frozenset({"training"})
_SAMPLES = 8  # rows of a tensor data set hashed at evenly spaced positions


def _plain(value: Any) -> Any:
    """``value`` as JSON-able builtins without memory addresses (what two processes can compare)."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return _DEVICE.sub(r"\1", _ADDRESS.sub("", value)) if isinstance(value, str) else value
    import torch

    if isinstance(value, torch.Tensor):  # its values, not its repr: a device (cuda:0, cuda:1) differs by rank
        return value.detach().cpu().tolist() if value.numel() <= 64 else [str(value.dtype), list(value.shape)]
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a NumPy scalar
        return value.item()
    return _DEVICE.sub(r"\1", _ADDRESS.sub("", repr(value)))


def _setting(value: Any) -> bool:
    """Whether ``value`` is a setting to compare (a number, string, flag, small tensor, or a short list or
    mapping of them) rather than an object, a function or state that grows."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() <= 64
    if isinstance(value, (list, tuple)):
        return len(value) <= 64 and all(_setting(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= 64 and all(isinstance(k, str) and _setting(v) for k, v in value.items())
    return hasattr(value, "item") and getattr(value, "shape", None) == ()  # a NumPy scalar


#: the packages whose classes' public attributes are settings (torch's modules, losses and schedulers,
#: nnx_es's callbacks and hooks); a class of the user's may keep a clock, a process id, a path or a
#: count of its own there, so it is compared by its name alone
_KNOWN = ("torch.", "nnx_es.")


def settings(obj: Any) -> dict[str, Any]:
    """``obj``'s class and, for a class of torch's or nnx_es's, its public attributes that are settings
    (:func:`_setting`): a module's ``p``, a loss's ``label_smoothing``, a scheduler's ``gamma``, early
    stopping's ``patience``. A class of the user's: its name alone (see :data:`_KNOWN`)."""
    cls = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if not cls.startswith(_KNOWN):
        return {"class": cls}
    attrs = getattr(obj, "__dict__", {})
    return {"class": cls, **{k: _plain(v) for k, v in sorted(attrs.items())
                             if not k.startswith("_") and k not in _NOT_SETTINGS and _setting(v)}}


def describe_callable(fn: Any) -> Any:
    """A loss or step function as two ranks can compare it: a ``functools.partial``'s function, arguments and
    keywords; a function's name and defaults (not what its closure captured: a start time, a scratch
    directory of its own); a module's or a callable object's :func:`settings`; ``None`` for ``None``."""
    import functools
    import types

    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return {"partial": describe_callable(fn.func), "args": _plain(list(fn.args)),
                "keywords": _plain(dict(fn.keywords))}
    if isinstance(fn, types.FunctionType):
        return {"function": f"{fn.__module__}.{fn.__qualname__}", "defaults": _plain(list(fn.__defaults__ or ())),
                "keywords": _plain(dict(fn.__kwdefaults__ or {}))}
    if isinstance(fn, (types.MethodType, types.BuiltinFunctionType)):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    return settings(fn)


def data_fingerprint(dataset: Any) -> str | None:
    """A short hash of a tensor data set (``TensorDataset``; a ``Subset``'s is its whole data set's, since a
    rank's own shard differs by design): its length, its tensors' dtypes and shapes, and :data:`_SAMPLES`
    rows at evenly spaced positions; ``None`` for any other data set (its ``__getitem__`` may decode files
    or draw augmentations: it is not called)."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if not isinstance(dataset, TensorDataset) or not dataset.tensors:
        return None
    n = len(dataset.tensors[0])
    h = hashlib.blake2b(digest_size=8)
    h.update(str(n).encode())
    rows = sorted({(n - 1) * k // (_SAMPLES - 1) for k in range(_SAMPLES)}) if n > 0 else []
    for t in dataset.tensors:
        h.update(f"{t.dtype}:{tuple(t.shape[1:])};".encode())
        for r in rows:
            h.update(t[r].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def declaration(started: RunStarted, train_loader: Any, val_loader: Any, *, net: Any, optimizers: Mapping[str, Any],
                objective: Any, schedulers: Sequence[Any], callbacks: Sequence[Any], update_hooks: Sequence[Any],
                steps: Mapping[str, Any], trainer_settings: Mapping[str, Any], own_partition: bool,
                fit_args: Mapping[str, Any]) -> dict[str, Any]:
    """What every rank of a data-parallel run must declare alike (:func:`check_alike`): the run's ``started``
    declaration but for what differs by design (the writer's own callbacks, the validation shard's length,
    library versions, the ``recipe`` metadata, the clock), the callbacks that run on every rank, the loss and
    ``steps`` functions (:func:`describe_callable`), update hooks, schedulers and every module by their
    :func:`settings`, the optimizers' hyperparameters, the parameters' names and shapes, the loaders'
    geometry, a fingerprint of tensor data sets (not of a partition of the user's own: ``own_partition``),
    the ``trainer_settings`` that decide when the ranks meet, and ``fit_args`` (``resume_from`` as given
    or not: a path may differ between hosts)."""
    declared = msgspec.structs.asdict(started)
    # (initial_weights: DistributedDataParallel broadcasts rank 0's weights when it wraps the net; the parameter
    # digests compare the ranks' weights from then on)
    for field in ("run_id", "wall_time_s", "library_versions", "callbacks", "loaders", "source", "recipe",
                  "initial_weights"):
        declared.pop(field)  # (the recipe's metadata, a per-host data path perhaps: logged when it differs)
    geometry = loader_geometries({"train": train_loader, "val": val_loader})
    train, val = geometry.get("train"), geometry.get("val")
    own = own_partition
    return {
        **declared, **fit_args, "resume_from": fit_args.get("resume_from") is not None,
        # a callback of nnx_es's by its settings (early stopping's patience), one of the user's by its class
        "callbacks": [settings(cb) | {"name": cb.name} for cb in callbacks if getattr(cb, "distributed", None) == "all"],
        "loss functions": {name: describe_callable(term.fn) for name, term in objective.terms.items()},
        "step functions": {name: describe_callable(fn) for name, fn in steps.items()},
        "update hooks": [settings(h) for h in update_hooks],
        "scheduler settings": {s.name: settings(s.scheduler) for s in schedulers},
        # every module's settings (a Dropout's p; the parameters are compared below)
        "modules": {name or "(net)": settings(m) for name, m in net.named_modules()},  # by path: modules['body.2']
        # a rank's own partition may hold a number of rows of its own (the batches are agreed apart)
        "train loader": train if not own or train is None else {"batch_size": train.batch_size},
        # a validation shard's length is its own (rows rank::world, unpadded)
        "validation loader": None if val is None else {"batch_size": val.batch_size,
                                                       "dataset_length": None if own else val.dataset_length},
        "optimizer hyperparameters": {name: [{k: v for k, v in g.items() if k != "params"} | {
            "parameters": len(g["params"])} for g in opt.param_groups] for name, opt in optimizers.items()},
        "parameters": [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in net.named_parameters()],
        # a loader of the user's own partition (DDP(own_partition=True)) may hold each rank's own rows
        "train data": None if own else data_fingerprint(getattr(train_loader, "dataset", None)),
        "validation data": None if own else data_fingerprint(getattr(val_loader, "dataset", None)),
        "settings": dict(trainer_settings),
    }


def check_alike(world: Any, declared: dict[str, Any], *, logged: dict[str, Any] | None = None) -> None:
    """Refuse, on every rank alike, a run whose ranks declare it differently (see the module docstring).

    Args:
        world: the run's world (:class:`~nnx_es.runtime.run_state.World`); one process: nothing is checked.
        declared: this rank's declaration, by field (any values: compared as builtins, memory
            addresses in a repr left out).
        logged: what may differ between hosts and is only logged when it does (library versions,
            the user's ``recipe`` metadata: a per-host data path).

    Raises:
        ConfigError: naming every field that differs and each rank's value (shortened), before
            anything is trained or written.
    """
    if world.size <= 1:
        return
    mine = {k: _plain(v) for k, v in declared.items()}
    digests = {k: hashlib.sha256(msgspec.json.encode(v, order="deterministic")).hexdigest()[:16]
               for k, v in mine.items()}
    everyone = world.gather({"digests": digests, "logged": _plain(logged or {})})
    differ = sorted(k for k in digests if len({r["digests"].get(k) for r in everyone}) > 1)
    for key in (logged or {}):
        values = [r["logged"].get(key) for r in everyone]
        if any(v != values[0] for v in values):
            log.warning(f"the ranks' {key} differ", values=values, rank=world.rank)
    if not differ:
        return
    # the values, for the message: gathered only now (a refusal), the same message on every rank
    values = world.gather({k: mine[k] for k in differ})
    parts = []
    for k in differ:
        where, theirs = _focus([v[k] for v in values])
        shown = "; ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(theirs))
        parts.append(f"{k}{where} ({shown})")
    raise ConfigError(
        f"the ranks do not declare the same run: {', '.join(parts)}; every rank must build the same trainer "
        "and call fit with the same arguments on the same data (a setting that depends on the rank, the host or "
        "the environment trains something else on one rank, and the averaged gradients mix them); nothing was "
        "trained or written")


def _focus(values: list[Any]) -> tuple[str, list[Any]]:
    """Where the ranks' ``values`` first differ, as a path (``[3]``, ``["loss"]``) and each rank's value
    there: descending while they are lists of one length or mappings of the same keys."""
    path = ""
    while True:
        first = values[0]
        if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
            i = next((i for i in range(len(first)) if any(v[i] != first[i] for v in values)), None)
        elif isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys() for v in values):
            i = next((k for k in first if any(v[k] != first[k] for v in values)), None)
        else:
            return path, values
        if i is None:
            return path, values
        path += f"[{i!r}]"
        values = [v[i] for v in values]


def _short(value: Any, limit: int = 160) -> str:
    text = msgspec.json.encode(value, order="deterministic").decode()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_trainer_alike(world: Any, trainer: Any, started: RunStarted, train_loader: Any, val_loader: Any,
                        fit_args: Mapping[str, Any], logged: Mapping[str, Any]) -> None:
    """:func:`check_alike` of a :class:`~nnx_es.Trainer`'s :func:`declaration` (its ``started`` declaration,
    its components, step functions and the settings that decide when the ranks meet) and ``fit_args``.

    Raises:
        ConfigError: see :func:`check_alike`.
    """
    plan = trainer.plan
    loop, commit = plan.loop, plan.commit
    declared = declaration(
        started, train_loader, val_loader, net=trainer.net, optimizers=trainer.optimizers,
        objective=trainer.objective, schedulers=trainer.schedulers, callbacks=trainer.callbacks,
        update_hooks=trainer.update_hooks,
        steps={"train_step_fn": trainer.engine.train_step_fn, "eval_step_fn": trainer.eval_step_fn,
               "trainer_step_fn": loop.step_fn, "val_batch_callback": trainer.val_batch_callback},
        trainer_settings={
            "validate_every": loop.cadence.every, "validate_every_steps": loop.cadence.every_steps,
            "final_validation": loop.final_validation, "nonfinite": loop.nonfinite,
            "checkpoint_lag": commit.lag, "phase_every": commit.phase_every, "keep_phases": commit.keep_phases,
            "keep_last": commit.keep_last, "keep_best": commit.keep_best, "metrics": plan.metrics,
            "batch_gather": loop.batch_gather, "custom_step": loop.custom_step},
        own_partition=trainer.distributed is not None and trainer.distributed.own_partition, fit_args=fit_args)
    check_alike(world, declared, logged=logged)
