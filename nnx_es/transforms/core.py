"""What every model transform shares: the base class, the net's record of what was applied, the
topology digest, and rebuilding a recorded list of transforms on a fresh net.

A transform changes a net in place (a submodule swapped for another, a pruning mask added, parameters
frozen); the root module is never replaced, so whoever holds the net holds the transformed one. Each
application is recorded on the net itself (:func:`applications`) with the net's topology before and
after (:func:`topology`). A checkpoint's ``topology`` component lists them (``"transforms"``:
``[{"transform": recipe document, "epoch": int}]``, written by :func:`nnx_es.runtime.components.capture` only when
there is one), and every reader of a checkpoint rebuilds that list on its fresh net before it loads the
weights (:func:`pending`): a stateful resume, a fork, ``NNModel.load``.

A transform is a recipe (:mod:`nnx_es.recipes`): its constructor's arguments are its attributes, so
:func:`~nnx_es.recipes.to_spec` reads it back as ``{"@type": "recipe", "target", "kwargs"}`` (one that
cannot be, e.g. a head whose constructor arguments are not recoverable, is refused when it is applied,
named). A recorded transform is someone else's JSON: it is rebuilt only through
:func:`~nnx_es.recipes.from_spec` with the ``"transform"`` slot (a subclass of :class:`Transform` from
:mod:`nnx_es.transforms`; a nested head: an ``nn.Module`` from ``torch.nn``), never unpickled.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import msgspec
import torch
from torch import nn

from events.schema import Topology
from nnx_es.errors import ConfigError, RecipeError

__all__ = ["Applied", "Transform", "applications", "apply_pending", "apply_transforms", "clone", "describe", "document",
           "extend", "match_modules", "pending", "probe", "rebuild", "recorded", "topology"]

#: the attribute of a net holding its :class:`Applied` records (kept by ``copy.deepcopy``)
_ATTR = "_nnx_es_transforms"


class Transform:
    """Base class of the model transforms (:mod:`nnx_es.transforms`).

    Subclasses implement :meth:`apply` (change ``net`` in place, raising :class:`ConfigError` naming
    the transform before changing anything it refuses). ``keeps_parameters``: applying it keeps every
    parameter object the net's optimizers hold and adds none (pruning): it may be applied during
    training by a callback, and rebuilt on a fresh net under an optimizer at a resume. Others (adapters,
    a new head, quantization) are declared before the optimizer is built (``Trainer(transforms=...)``).
    """

    keeps_parameters: ClassVar[bool] = False

    def apply(self, net: nn.Module) -> None:
        raise NotImplementedError

    def check(self, net: nn.Module) -> None:
        """Raise what :meth:`apply` would raise on ``net``, changing nothing: what a transform applied later
        in the run (:class:`~nnx_es.transforms.TransformAt`) is checked with before training. The default
        applies it to a copy of ``net``; a subclass that can tell more cheaply overrides it.

        Raises:
            ConfigError: ``net`` is refused (named, as :meth:`apply` names it).
        """
        self.apply(clone(net))

    def __repr__(self) -> str:
        try:
            kwargs = describe(self)
        except ConfigError:
            return f"{type(self).__name__}(...)"
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


class Applied(NamedTuple):
    """One application of a transform to a net: its recipe document, the 0-based epoch at whose boundary it
    was applied (-1: before training), who applied it (``"trainer"``, ``"callback"``, ``"checkpoint"``,
    ``"user"``), and the net's topology before and after."""

    transform: dict[str, Any]
    epoch: int
    origin: str
    before: Topology
    after: Topology


def document(transform: Transform) -> dict[str, Any]:
    """``transform``'s recipe as JSON builtins (what events and checkpoints hold).

    Raises:
        ConfigError: it is not a :class:`Transform`, or its recipe cannot be recovered or encoded (named).
    """
    from nnx_es.recipes import to_spec

    if not isinstance(transform, Transform):
        raise ConfigError(f"a transform must be an nnx_es.transforms.Transform (Prune, LoRA, ReplaceHead, Quantize), "
                          f"got {transform!r}")
    try:
        return msgspec.to_builtins(to_spec(transform))  # type: ignore[no-any-return]
    except RecipeError as exc:
        raise ConfigError(f"transform {type(transform).__name__} cannot be recorded as a recipe, so no checkpoint "
                          f"could rebuild it: {exc}") from None


def describe(transform: Transform) -> dict[str, Any]:
    """The keyword arguments of ``transform``'s recipe (for messages)."""
    return dict(document(transform).get("kwargs", {}))


def _name(doc: Any) -> str:
    """A recorded transform in a message: ``Prune(amount=0.5, ...)`` (its text bounded)."""
    if not isinstance(doc, dict):
        return repr(doc)[:120]
    target = str(doc.get("target", "?")).rsplit(":", 1)[-1]
    kwargs = doc.get("kwargs") if isinstance(doc.get("kwargs"), dict) else {}
    text = f"{target}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    return text if len(text) <= 160 else text[:157] + "..."


def topology(net: nn.Module) -> Topology:
    """The digest of ``net``'s structure: every module's path and type, every parameter's and buffer's
    name, shape and dtype (in registration order); the counts of modules, parameter elements and
    trainable (``requires_grad``) parameter elements."""
    h = hashlib.sha256()
    modules = 0
    for path, module in net.named_modules():
        modules += 1
        h.update(f"m {path} {type(module).__module__}.{type(module).__qualname__}\n".encode())
    total = trainable = 0
    for name, p in net.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype}\n".encode())
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    for name, b in net.named_buffers():
        h.update(f"b {name} {tuple(b.shape)} {b.dtype}\n".encode())
    return Topology(sha256=h.hexdigest(), modules=modules, parameters=total, trainable=trainable)


def applications(net: nn.Module) -> list[Applied]:
    """The transforms applied to ``net``, in order (empty: none)."""
    return list(getattr(net, _ATTR, ()))


def recorded(net: nn.Module) -> list[dict[str, Any]]:
    """What a checkpoint's ``topology["transforms"]`` holds for ``net``: ``{"transform", "epoch"}`` each."""
    return [{"transform": a.transform, "epoch": a.epoch} for a in applications(net)]


def _apply_one(net: nn.Module, transform: Transform, *, origin: str, epoch: int) -> Applied:
    doc = document(transform)
    before = topology(net)
    transform.apply(net)
    done = Applied(doc, epoch, origin, before, topology(net))
    net.__dict__[_ATTR] = (*applications(net), done)
    return done


def extend(net: nn.Module, transforms: Iterable[Transform], *, origin: str = "user", epoch: int = -1) -> list[Applied]:
    """Apply ``transforms`` to ``net`` in place, in order, after those it carries; return their records.

    Raises:
        ConfigError: a transform is not recordable (checked for all before any is applied) or refuses ``net``.
    """
    wanted = list(transforms)
    for t in wanted:
        document(t)
    return [_apply_one(net, t, origin=origin, epoch=epoch) for t in wanted]


def apply_transforms(net: nn.Module, transforms: Iterable[Transform], *, origin: str = "user",
                     epoch: int = -1) -> nn.Module:
    """Make ``net`` carry ``transforms`` after what it carries: those of them it already carries last (applied
    before its optimizer was built: the longest start of ``transforms`` that ends the net's list) are kept, the
    rest applied in place, in order. Returns ``net``. (A net loaded from a transformed run carries that run's
    transforms first; ``transforms`` come after them.)

    Raises:
        ConfigError: a transform is not recordable (see :func:`document`), or refuses ``net`` (named).
    """
    wanted = list(transforms)
    docs = [document(t) for t in wanted]
    have = [a.transform for a in applications(net)]
    done = next(k for k in range(min(len(have), len(docs)), -1, -1) if k == 0 or have[-k:] == docs[:k])
    extend(net, wanted[done:], origin=origin, epoch=epoch)
    return net


def match_modules(net: nn.Module, patterns: Sequence[str] | None, kinds: tuple[type, ...], transform: str
                  ) -> list[tuple[str, nn.Module]]:
    """The submodules of ``net`` a transform acts on: those whose dotted path matches one of ``patterns``
    (``fnmatch``; None: every submodule of ``kinds``), each checked to be one of ``kinds``.

    Raises:
        ConfigError: a pattern matches no submodule, or matches one of another kind (named, with the
            paths of the right kind there are).
    """
    candidates = [(p, m) for p, m in net.named_modules() if p]
    if patterns is None:
        found = [(p, m) for p, m in candidates if isinstance(m, kinds)]
    else:
        found = [(p, m) for p, m in candidates if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
        missing = [pat for pat in patterns if not any(fnmatch.fnmatchcase(p, pat) for p, _ in candidates)]
        if missing:
            raise ConfigError(f"{transform}: targets {missing} match no submodule of the net; its submodules: "
                              f"{[p for p, _ in candidates][:20]}")
    wrong = [f"{p} ({type(m).__name__})" for p, m in found if not isinstance(m, kinds)]
    if wrong:
        ok = [p for p, m in candidates if isinstance(m, kinds)]
        raise ConfigError(f"{transform} acts on {' / '.join(k.__name__ for k in kinds)} layers; targets matched "
                          f"{wrong}; the net's such layers: {ok[:20]}")
    if not found:
        raise ConfigError(f"{transform}: the net has no {' / '.join(k.__name__ for k in kinds)} layer to act on")
    return found


def rebuild(doc: Any, allowed: Any = None) -> Transform:
    """The transform a recorded recipe document names, built through the ``"transform"`` slot.

    Raises:
        CorruptCheckpointError: the document is not a transform's recipe, or its target or arguments are
            refused (named): the transform cannot be re-applied.
    """
    from nnx_es.errors import CorruptCheckpointError
    from nnx_es.recipes import from_spec

    try:
        built = from_spec(doc, allowed=allowed, slot="transform")
    except (RecipeError, ConfigError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"the checkpoint's transform {_name(doc)} cannot be re-applied: {exc}") from None
    if not isinstance(built, Transform):
        raise CorruptCheckpointError(f"the checkpoint's transform {_name(doc)} is not a transform")
    return built


def pending(net: nn.Module, topology_state: Any, *, where: str, training: bool) -> list[tuple[Transform, int]]:
    """The transforms a checkpoint's ``topology`` records that ``net`` does not carry yet, rebuilt, with
    their epochs: what to apply to ``net`` before its weights load. Nothing is applied here.

    ``training``: the net trains on under optimizers built over its parameters (a resume, a fork, a
    weights-only start): only transforms that keep every parameter (:attr:`Transform.keeps_parameters`)
    may be rebuilt now; the others must be declared, ``Trainer(transforms=[...])``.

    Raises:
        CorruptCheckpointError: a recorded entry is malformed or cannot be rebuilt (named).
        ConfigError: ``net`` carries transforms the checkpoint's net did not (or in another order), or
            (``training``) a transform that adds or removes parameters is not declared (named).
    """
    from nnx_es.errors import CorruptCheckpointError

    entries = topology_state.get("transforms", []) if isinstance(topology_state, dict) else []
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("epoch"), int) and isinstance(e.get("transform"), dict)
            for e in entries):
        raise CorruptCheckpointError(f"{where}: its topology's transforms are malformed: {repr(entries)[:200]}")
    have = [a.transform for a in applications(net)]
    docs = [e["transform"] for e in entries]
    if docs[:len(have)] != have:
        raise ConfigError(f"{where} was saved from a net transformed by [{', '.join(map(_name, docs))}], but this net "
                          f"carries [{', '.join(map(_name, have))}]: declare the same transforms, in the same order")
    todo = [(rebuild(e["transform"]), e["epoch"]) for e in entries[len(have):]]
    if training:
        for t, epoch in todo:
            if not t.keeps_parameters:
                raise ConfigError(
                    f"{where} was saved from a net transformed by {_name(document(t))} (epoch {epoch}), which "
                    "changes the net's parameters, so this trainer's optimizers cannot hold them unless it is applied "
                    "before they are built: declare it, Trainer(transforms=[...]) (NNModel.train(transforms=...)), "
                    "with the checkpoint's transforms in order")
    return todo


def apply_pending(net: nn.Module, todo: Sequence[tuple[Transform, int]]) -> None:
    """Apply :func:`pending`'s transforms to ``net`` (recorded as rebuilt from a checkpoint)."""
    for t, epoch in todo:
        extend(net, [t], origin="checkpoint", epoch=epoch)


def clone(net: nn.Module) -> nn.Module:
    """A deep copy of ``net``. A masked-pruned layer keeps the product ``weight_orig * weight_mask`` of its last
    forward as a plain attribute, a tensor of that forward's graph that ``copy.deepcopy`` refuses: it is
    recomputed without a graph first (its forward recomputes it anyway)."""
    from torch.nn.utils import prune

    with torch.no_grad():
        for module in net.modules():
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, prune.BasePruningMethod):
                    setattr(module, hook._tensor_name, hook.apply_mask(module))
    return copy.deepcopy(net)


def probe(net: nn.Module, todo: Sequence[tuple[Transform, int]]) -> nn.Module:
    """``net`` as it will be once ``todo`` is applied (a copy when there is anything to apply): what a
    checkpoint's weights are checked against before anything is changed."""
    if not todo:
        return net
    copied = clone(net)
    apply_pending(copied, todo)
    return copied
