"""Fine-tuning: start from another run's weights (or a ``state_dict``), freeze by name, layer-wise lrs.

* :class:`WeightsFrom` -- ``Trainer(init_from=WeightsFrom("runs/pre", "best", strict=False))``
  loads a run's BEST/LAST (hash-verified, as ``NNModel.load`` reads them) or a ``state_dict``
  into the net when the Trainer is built, before anything trains. The policy for keys that do
  not match is explicit: ``strict=True`` (default) refuses any difference, naming the keys;
  ``strict=False`` loads every key whose name and shape match and lists exactly the others:
  ``skipped`` (in the source, not loaded: absent from the net or of another shape) and ``new``
  (in the net, not loaded: they keep the net's own initialization -- a new head). The source
  and both lists are recorded in ``run_started.lineage``.
* :class:`Freeze` -- a callback: parameters whose names match a pattern (``fnmatch``:
  ``"backbone.*"``) get ``requires_grad=False`` until epoch ``until_epoch`` (0-based; None:
  for the whole run). Whether a parameter trains is a function of the epoch alone, set at the
  start of every epoch, so a resumed run (LAST is at epoch boundaries) freezes exactly as the
  uninterrupted one did; the optimizer skips a parameter without a gradient, so its state
  starts when it is unfrozen, in both runs alike. A frozen module's normalization layers
  (BatchNorm and the like, tracking running statistics) are frozen too by default
  (``norm_stats="freeze"``): they normalize with their running statistics and do not update
  them -- in eval mode while frozen, as a frozen backbone is fine-tuned (torchvision's
  ``FrozenBatchNorm2d``, detectron2's ``freeze_at``); ``norm_stats="update"`` leaves them
  in train mode, their statistics following the batches (the behaviour before this option).
* :func:`param_groups` -- optimizer parameter groups by name pattern with lr multipliers, or
  layer-wise decay over the net's top-level children; each group keeps a ``name``. Their
  learning rates are in every receipt (``update_committed.lrs``, one per group, in order) and
  the group names in ``run_started.param_groups``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from events.schema import Lineage
from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.evaluation import state_fingerprint
from nnx_es.weights import fitting_models, read_weights

__all__ = ["NORM_STATS", "Freeze", "WeightsFrom", "group_names", "initial_weights", "load_weights", "param_groups"]


class WeightsFrom:
    """Where a fine-tuning run's initial weights come from (see the module docstring).

    Args:
        source: a run directory (``runs/<id>``) or a ``state_dict`` (a mapping of tensors).
        which: with a run, ``"best"`` or ``"last"``.
        strict: refuse any key that does not match (True), or load the matching ones and record
            the others (False).
        weights: with a run, ``"raw"`` (the net's own, default) or ``"evaluated"`` (the averaged
            weights when the run had an EMA hook), as :meth:`nnx_es.NNModel.load`.
        model: with a run of several models, the one whose weights to start from (its keys without
            the ``"<model>."`` prefix, :mod:`nnx_es.weights`); recorded in the lineage.

    Raises:
        ConfigError: a bad argument.
    """

    def __init__(self, source: str | Path | Mapping[str, Any], which: str = "best", *, strict: bool = True,
                 weights: str = "raw", model: str | None = None) -> None:
        if not isinstance(source, (str, Path, Mapping)):
            raise ConfigError(f"WeightsFrom source must be a run directory or a state_dict, got {type(source).__name__}")
        if which not in ("best", "last"):
            raise ConfigError(f"which must be 'best' or 'last', got {which!r}")
        if weights not in ("raw", "evaluated"):
            raise ConfigError(f"weights must be 'raw' or 'evaluated', got {weights!r}")
        if not isinstance(strict, bool):
            raise ConfigError(f"strict must be True or False, got {strict!r}")
        if model is not None and (isinstance(source, Mapping) or not (isinstance(model, str) and model.isidentifier())):
            raise ConfigError(f"model must be the name of a model of the source run (an identifier), given with a run "
                              f"directory, got model={model!r} with a {type(source).__name__} source")
        self.source, self.which, self.strict, self.weights, self.model = source, which, strict, weights, model

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state_dict, lineage fields)`` of the source.

        Raises:
            CheckpointUnavailableError: the run has no such checkpoint, or it was pruned.
            CorruptCheckpointError: a manifest or blob does not verify.
        """
        if isinstance(self.source, Mapping):
            state = dict(self.source)
            return state, {"kind": "state_dict", "state_sha256": state_fingerprint(state)}
        state, result, pointer = read_weights(Path(self.source), self.which, self.weights, model=self.model)
        lineage = {"kind": "run", "run_id": result.run_id, "checkpoint": self.which, "manifest": pointer.manifest,
                   "epoch": pointer.epoch}
        return state, (lineage if self.model is None else {**lineage, "model": self.model})


def load_weights(net: nn.Module, init: WeightsFrom) -> Lineage:
    """Load ``init``'s weights into ``net`` by its key policy; return the lineage to record.

    Raises:
        ConfigError: ``strict=True`` and keys differ (each named: missing, unexpected, shapes), or no
            key matches at all (another architecture).
    """
    state, fields = init.state()
    own = net.state_dict()
    skipped, new = [], []
    for key, value in state.items():
        if key not in own:
            skipped.append(key)
        elif getattr(value, "shape", None) != own[key].shape:
            skipped.append(key)
            new.append(key)
    new = sorted(set(new) | {k for k in own if k not in state})
    skipped = sorted(skipped)
    if init.strict and (skipped or new):
        shapes = [f"{k}: {tuple(state[k].shape)} in the source, {tuple(own[k].shape)} in the net"
                  for k in skipped if k in own]
        fits = fitting_models(state, own) if init.model is None and isinstance(init.source, (str, Path)) else []
        what = (f"its keys under {fits[0] + '.'!r} are this net's (a several-model run's {fits[0]!r}): "
                f"pass WeightsFrom(..., model={fits[0]!r})" if fits else
                "pass WeightsFrom(..., strict=False) to load the keys that match and keep the net's own for the "
                "others (a new head)")
        raise ConfigError(
            f"the initial weights do not fit the net (strict=True): only in the source {sorted(set(skipped) - set(own))}, "
            f"only in the net {sorted(set(new) - set(state))}, other shapes {shapes}; {what}")
    loaded = {k: v for k, v in state.items() if k not in skipped}
    if not loaded:
        raise ConfigError(f"no key of the initial weights fits the net (source keys {sorted(state)[:6]}..., net keys "
                          f"{sorted(own)[:6]}...): another architecture?")
    net.load_state_dict(loaded, strict=False)
    return Lineage(strict=init.strict, skipped=skipped, new=new, **fields)


def initial_weights(net: nn.Module, init_from: Any) -> Lineage | None:
    """``Trainer(init_from=...)``: load it into ``net`` (a ``state_dict`` is loaded strictly); its lineage, or None.

    Raises:
        ConfigError: neither None, a WeightsFrom nor a mapping; or see :func:`load_weights`.
    """
    if init_from is None:
        return None
    if isinstance(init_from, Mapping):
        init_from = WeightsFrom(init_from)
    if not isinstance(init_from, WeightsFrom):
        raise ConfigError(f"init_from must be a WeightsFrom or a state_dict, got {type(init_from).__name__}")
    return load_weights(net, init_from)


def group_names(optimizers: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each optimizer's parameter group names in order (``"group<i>"`` for a group without a ``name``)."""
    return {n: [str(g.get("name", f"group{i}")) for i, g in enumerate(o.param_groups)] for n, o in optimizers.items()}


#: what ``Freeze(norm_stats=...)`` does with a frozen module's normalization layers
NORM_STATS = ("freeze", "update")


class Freeze(Callback):
    """Freeze the parameters whose names match ``patterns`` until 0-based epoch ``until_epoch``.

    ``Freeze(["backbone.*"], until_epoch=3)``: epochs 0-2 train the rest only; from epoch 3 on
    everything trains. ``until_epoch=None``: frozen for the whole run. Set at the start of each
    epoch from the epoch alone, so it survives a resume exactly (module docstring).

    ``norm_stats``: ``"freeze"`` (default) puts every normalization layer tracking running
    statistics (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, an ``InstanceNorm`` with
    ``track_running_stats=True``) whose parameters the patterns all match (one without
    parameters: whose ``running_mean`` they match) in eval mode while frozen -- it normalizes
    with its running statistics and leaves them as they are -- again after a validation pass
    within the epoch (which restores train mode); ``"update"`` leaves them in train mode (their
    statistics follow the batches while their weights are frozen). After the run a layer frozen
    to its end stays in eval mode until ``net.train()``.

    Raises:
        ConfigError: no pattern, a bad ``norm_stats``, or (at the run's start) a pattern that
            matches no parameter.
    """

    def __init__(self, patterns: Sequence[str], until_epoch: int | None = None, *, norm_stats: str = "freeze",
                 name: str = "Freeze") -> None:
        if isinstance(patterns, str):
            patterns = [patterns]
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise ConfigError(f"Freeze needs module/parameter name patterns, got {patterns!r}")
        if until_epoch is not None and (isinstance(until_epoch, bool) or not isinstance(until_epoch, int)
                                        or until_epoch < 0):
            raise ConfigError(f"until_epoch must be an int >= 0 or None, got {until_epoch!r}")
        if norm_stats not in NORM_STATS:
            raise ConfigError(f"Freeze(norm_stats=...) must be one of {NORM_STATS}, got {norm_stats!r}: 'freeze' "
                              "keeps a frozen module's BatchNorm statistics, 'update' lets them follow the batches")
        self.patterns, self.until_epoch, self.norm_stats, self._name = list(patterns), until_epoch, norm_stats, name

    @property
    def name(self) -> str:
        return self._name

    def recipe_kwargs(self) -> dict[str, Any]:
        return {"patterns": self.patterns, "until_epoch": self.until_epoch, "norm_stats": self.norm_stats,
                "name": self._name}

    def _matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def matching(self, net: nn.Module) -> list[str]:
        """The names of the parameters the patterns match."""
        return [n for n, _ in net.named_parameters() if self._matches(n)]

    def norm_layers(self, net: nn.Module) -> list[str]:
        """The names of the normalization layers tracking running statistics that the patterns freeze."""
        out = []
        for mname, m in net.named_modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                prefix = f"{mname}." if mname else ""
                names = [prefix + n for n, _ in m.named_parameters(recurse=False)] or [f"{prefix}running_mean"]
                if all(self._matches(n) for n in names):
                    out.append(mname)
        return out

    def frozen_at(self, epoch: int) -> bool:
        return self.until_epoch is None or epoch < self.until_epoch

    def _apply(self, ctx: Any) -> None:
        train = not self.frozen_at(ctx.epoch)
        names = set(self.matching(ctx.net))
        for n, p in ctx.net.named_parameters():
            if n in names:
                p.requires_grad_(train)
        self._norms_to_eval(ctx)

    def _norms_to_eval(self, ctx: Any) -> None:
        """While frozen (``norm_stats="freeze"``), the frozen normalization layers in eval mode; the
        loop's ``net.train()`` at each epoch's start puts them back otherwise."""
        if self.norm_stats == "freeze" and self.frozen_at(ctx.epoch) and ctx.net.training:
            modules = dict(ctx.net.named_modules())
            for mname in self.norm_layers(ctx.net):
                modules[mname].eval()

    def on_train_begin(self, ctx: Any) -> None:
        unmatched = [p for p in self.patterns
                     if not any(fnmatch.fnmatchcase(n, p) for n, _ in ctx.net.named_parameters())]
        if unmatched:
            raise ConfigError(f"Freeze patterns {unmatched} match no parameter of the net (its parameters: "
                              f"{[n for n, _ in ctx.net.named_parameters()][:8]}...)")
        self._apply(ctx)

    def on_epoch_begin(self, ctx: Any) -> None:
        self._apply(ctx)

    def on_validation_end(self, ctx: Any, metrics: Any) -> None:
        self._norms_to_eval(ctx)  # a pass within the epoch (validate_every_steps) restored train mode

    def state_dict(self) -> dict[str, Any]:
        """Its settings: held in LAST, so a stateful resume without this freeze (or with another) is refused."""
        return {"patterns": list(self.patterns), "until_epoch": self.until_epoch, "norm_stats": self.norm_stats}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ResumeError: the run froze other parameters, until another epoch, or treated the
        normalization statistics otherwise (a run checkpointed before ``norm_stats`` existed updated them)."""
        theirs = state.get("norm_stats", "update")
        if list(state.get("patterns", [])) != self.patterns or state.get("until_epoch") != self.until_epoch \
                or theirs != self.norm_stats:
            raise ResumeError(f"cannot resume with {self.name}(patterns={self.patterns}, until_epoch="
                              f"{self.until_epoch}, norm_stats={self.norm_stats!r}): the run froze "
                              f"{state.get('patterns')} until epoch {state.get('until_epoch')} with "
                              f"norm_stats={theirs!r}; pass the run's freeze schedule again")


def param_groups(net: nn.Module, lr: float, *, rules: Sequence[tuple[str, float]] = (),
                 layer_decay: float | None = None) -> list[dict[str, Any]]:
    """Optimizer parameter groups: ``[{"params": [...], "lr": ..., "name": ...}, ...]``.

    ``rules``: ``(pattern, multiplier)`` in order; a parameter goes to the first pattern its
    name matches (``fnmatch``), with ``lr * multiplier``; the others to ``"default"`` (``lr``).
    ``layer_decay``: instead, one group per top-level child of ``net`` in order, the last with
    ``lr`` and each one before it ``layer_decay`` times its successor's (BEiT/ELECTRA style).

    Raises:
        ConfigError: both or a bad value given, a rule matching no parameter, or groups left empty.
    """
    if rules and layer_decay is not None:
        raise ConfigError("param_groups takes rules or layer_decay, not both")
    named = list(net.named_parameters())
    if layer_decay is not None:
        if not 0.0 < layer_decay <= 1.0:
            raise ConfigError(f"layer_decay must be in (0, 1], got {layer_decay!r}")
        children = [(n, m) for n, m in net.named_children() if any(True for _ in m.parameters())]
        if not children:
            raise ConfigError("layer_decay needs a net with child modules holding parameters")
        groups = []
        depth = len(children)
        for i, (cname, child) in enumerate(children):
            groups.append({"params": list(child.parameters()), "lr": lr * layer_decay ** (depth - 1 - i),
                           "name": cname})
        own = [p for n, p in named if "." not in n]
        if own:
            groups.insert(0, {"params": own, "lr": lr * layer_decay ** depth, "name": "(root)"})
        return groups
    by_rule: dict[int, list[nn.Parameter]] = {}
    rest = []
    for n, p in named:
        i = next((i for i, (pattern, _) in enumerate(rules) if fnmatch.fnmatchcase(n, pattern)), None)
        if i is None:
            rest.append(p)
        else:
            by_rule.setdefault(i, []).append(p)
    unused = [rules[i][0] for i in range(len(rules)) if i not in by_rule]
    if unused:
        raise ConfigError(f"param_groups rules {unused} match no parameter (names: {[n for n, _ in named][:8]}...)")
    groups = [{"params": by_rule[i], "lr": lr * float(mult), "name": pattern} for i, (pattern, mult) in enumerate(rules)]
    if rest:
        groups.append({"params": rest, "lr": lr, "name": "default"})
    return groups
