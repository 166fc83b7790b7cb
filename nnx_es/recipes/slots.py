"""The registry of slots: what a recipe standing in each place of a spec may resolve to.

Every place a recipe can stand has an expected type -- a spec's ``model`` an ``nn.Module``
subclass, an optimizer a ``torch.optim.Optimizer`` subclass, a ``Scheduler``'s inner scheduler an
``LRScheduler``, a callback a :class:`~nnx_es.callbacks.Callback` ... (:data:`SLOTS`). A slot says

* ``bases``: the classes a recipe there must subclass (checked after the import, on the class);
* ``homes``: where in ``torch`` / ``nnx_es`` such classes live (dotted prefixes, checked on the
  path's text before anything is imported);
* ``factories``: the functions trusted code registered for the slot (:func:`register`), by
  exact dotted name; a factory's result must again be of ``bases``;
* ``holds``: ``"object"`` (a recipe builds it: the target is called), ``"function"`` (an
  ``@ref`` names a function the runtime calls later: a step function, an ``lr_lambda``, a
  ``LambdaCallback`` hook, a per-row loss) or ``"both"`` (a loss term: a loss module's recipe,
  or a loss function's ``@ref``).

The user's own packages (``--allow PKG``, :class:`~nnx_es.recipes.imports.Allowed`'s ``user``)
may hold classes of a slot's bases and functions (a factory for an object slot, the function
itself for a function slot); they are type-checked like the rest.

A nested keyword is typed by :data:`PARAMETERS` (trusted classes whose annotations are too
loose: ``Scheduler(scheduler=...)``, ``Objective(terms=...)``), else by the parameter's
annotation (a class ``C``, ``C | None``, ``list[C]``, ``Mapping[str, C]``: a recipe there
subclasses ``C``), else it takes plain data only. The model is LightningCLI / jsonargparse's
(a ``class_path`` must be a subclass of the parameter's type).
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from nnx_es.errors import RecipeError, UnsafeRecipeError

__all__ = ["COMPONENT", "PARAMETERS", "SLOTS", "Slot", "known_anywhere", "parameter_slot", "register", "registered",
           "under"]


def under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or inside one (``torchvision`` is not under ``torch``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Slot:
    """What a recipe in one place of a spec may resolve to (the module docstring)."""

    name: str
    bases: tuple[str | type, ...] = ()
    homes: tuple[str, ...] = ()
    factories: tuple[str, ...] = ()
    holds: str = "object"

    @property
    def takes_recipe(self) -> bool:
        """Whether a recipe (an object built by calling its target) may stand here."""
        return self.holds in ("object", "both")

    @property
    def takes_ref(self) -> bool:
        """Whether an ``@ref`` (a function itself) may stand here."""
        return self.holds in ("function", "both")

    def functions_only(self) -> Slot:
        """This slot for an ``@ref``: its functions, no class."""
        return replace(self, holds="function")

    def classes(self) -> tuple[type, ...]:
        """The base classes, imported (trusted paths of this module, or classes given)."""
        return tuple(b if isinstance(b, type) else _class(b) for b in self.bases)

    def admits_text(self, dotted: str, user: Iterable[str]) -> bool:
        """Whether the dotted path ``dotted`` may be imported for this slot: under a home, a registered
        function, or in the user's own packages."""
        return under(dotted, self.homes) or dotted in self.factories or under(dotted, user)

    def check_text(self, path: str, dotted: str, user: Iterable[str]) -> None:
        """Refuse ``path`` (dotted: ``dotted``) from its text, before anything is imported.

        Raises:
            UnsafeRecipeError: naming the path, the slot and what it takes.
        """
        if not self.admits_text(dotted, user):
            raise UnsafeRecipeError(f"recipe path {path!r} is not {self.describe()}; refused, nothing imported"
                                    f"{self._did_you_mean(dotted)}")

    def _did_you_mean(self, dotted: str) -> str:
        """The paths of this slot's own classes and factories with the name ``dotted`` ends in, as a hint
        (`` (did you mean 'nnx_es.diagnostics.recorder:Diagnostics'?)``), read from the registry's text:
        what ``dotted`` itself would import to is not looked at (nothing refused is imported)."""
        name = dotted.rpartition(".")[2]
        near = [":".join(h.rpartition(".")[::2]) for h in (*self.homes, *self.factories)
                if h.rpartition(".")[2] == name and h != dotted]
        return f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""

    def check_object(self, obj: Any, path: str, real: str, user: Iterable[str]) -> None:
        """Refuse what ``path`` imported (``real``: its own ``__module__.__qualname__``) unless it is of this slot.

        Raises:
            UnsafeRecipeError: a class of another base, a function nobody registered, an alias.
        """
        users = tuple(user)
        if inspect.isclass(obj):
            ok = (self.takes_recipe and issubclass(obj, self.classes())
                  and (under(real, self.homes) or under(real, users)))
        else:
            ok = real in self.factories or (inspect.isfunction(obj) and under(real, users))
        if not ok:
            what = "class" if inspect.isclass(obj) else "function"
            raise UnsafeRecipeError(f"recipe path {path!r} is the {what} {real!r}, not {self.describe()}; refused")

    def describe(self) -> str:
        """What the slot takes, in words."""
        bases = ", ".join(b if isinstance(b, str) else f"{b.__module__}:{b.__qualname__}" for b in self.bases)
        if not self.takes_recipe:
            what = f"a function for {self.name} (registered, or from a package --allow names)"
        else:
            what = f"a {self.name}: a subclass of {bases}" if bases else f"a {self.name} factory"
            what += " or a factory registered for it"
        return what


#: expected base classes, by path (imported on first use: trusted constants)
_CLASS_CACHE: dict[str, type] = {}


def _class(path: str) -> type:
    cls = _CLASS_CACHE.get(path)
    if cls is None:
        module, _, qualname = path.partition(":")
        obj: Any = importlib.import_module(module)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
        cls = _CLASS_CACHE[path] = obj
    return cls


_MODULE, _OPTIMIZER = "torch.nn.modules.module:Module", "torch.optim.optimizer:Optimizer"
_LR_SCHEDULER, _CALLBACK = "torch.optim.lr_scheduler:LRScheduler", "nnx_es.callbacks:Callback"
_OBJECTIVE, _TERM = "nnx_es.objective:Objective", "nnx_es.objective:Term"

#: slot name -> slot; :func:`register` adds factories
SLOTS: dict[str, Slot] = {s.name: s for s in (
    Slot("model", (_MODULE,), ("torch.nn", "nnx_es.recipes.models", "nnx_es.models")),
    Slot("optimizer", (_OPTIMIZER,), ("torch.optim",)),
    Slot("lr_scheduler", (_LR_SCHEDULER,), ("torch.optim.lr_scheduler", "torch.optim.swa_utils")),
    Slot("scheduler", ("nnx_es.schedulers:Scheduler",), ("nnx_es.schedulers.Scheduler",)),
    Slot("loss", (_OBJECTIVE, _TERM, _MODULE), ("torch.nn", "nnx_es.objective.Objective", "nnx_es.objective.Term",
                                                 "nnx_es.models.Keyed")),
    Slot("loss_weight", ("nnx_es.loss_weights:WeightSchedule",), ("nnx_es.loss_weights",)),
    Slot("callback", (_CALLBACK,), ("nnx_es.callbacks", "nnx_es.finetune.Freeze", "nnx_es.transforms.callback.TransformAt",
                                   "nnx_es.search.pruning.TrialPruning", "nnx_es.diagnostics.recorder.Diagnostics")),
    # a model transform (nnx_es.transforms): what a checkpoint's topology records and a load rebuilds
    Slot("transform", ("nnx_es.transforms.core:Transform",), ("nnx_es.transforms",)),
    Slot("hook", ("nnx_es.update_hooks:UpdateHook",), ("nnx_es.update_hooks",)),
    Slot("monitor", ("nnx_es.monitor:Monitor",), ("nnx_es.monitor.Monitor",)),
    Slot("data", (), (), ("nnx_es.recipes.data.tabular",)),
    Slot("step", (), (), ("nnx_es.runtime.engine.default_forward", "nnx_es.runtime.steps.default_train_step"), holds="function"),
    Slot("lr_lambda", holds="function"),
    Slot("callback_hook", holds="function"),
    Slot("loss_function", holds="function"),
)}

#: (class, parameter) -> the slot of its values, for trusted classes whose annotations say too little
#: (``"**"``: the keywords a ``**kwargs`` takes); subclasses inherit their bases' entries
PARAMETERS: dict[tuple[str, str], str] = {
    ("nnx_es.schedulers.Scheduler", "scheduler"): "lr_scheduler",
    ("torch.optim.lr_scheduler.SequentialLR", "schedulers"): "lr_scheduler",
    ("torch.optim.lr_scheduler.ChainedScheduler", "schedulers"): "lr_scheduler",
    ("torch.optim.lr_scheduler.LambdaLR", "lr_lambda"): "lr_lambda",
    ("torch.optim.lr_scheduler.MultiplicativeLR", "lr_lambda"): "lr_lambda",
    ("nnx_es.objective.Objective", "terms"): "loss_term",
    ("nnx_es.objective.Term", "fn"): "loss_term",
    ("nnx_es.objective.Term", "weight"): "loss_weight",
    ("nnx_es.callbacks.LambdaCallback", "**"): "callback_hook",
}


def _loss_term() -> Slot:
    """A loss term: a loss module or a :class:`~nnx_es.objective.Term` built from a recipe, or a per-row loss
    function named by ``@ref`` (:data:`SLOTS` ``"loss_function"``)."""
    loss = SLOTS["loss"]
    return replace(loss, name="loss term", factories=loss.factories + SLOTS["loss_function"].factories, holds="both")


def slot(name: str) -> Slot:
    """The slot called ``name`` (``"loss_term"``: a loss module, a Term, or a loss function by ``@ref``)."""
    return _loss_term() if name == "loss_term" else SLOTS[name]


def component() -> Slot:
    """Any typed object slot of a spec (what :func:`~nnx_es.recipes.from_spec` builds when no slot is named; a
    data factory, whose result has no base to check, is built with ``slot="data"`` only)."""
    objects = [s for s in SLOTS.values() if s.takes_recipe and s.bases]
    return Slot("spec component", tuple(dict.fromkeys(b for s in objects for b in s.bases)),
                tuple(dict.fromkeys(h for s in objects for h in s.homes)),
                tuple(dict.fromkeys(f for s in objects for f in s.factories)))


#: the name :func:`from_spec` takes for :func:`component`
COMPONENT = "component"


def known_anywhere(dotted: str, user: Iterable[str]) -> bool:
    """Whether ``dotted`` could stand in some slot (checked on every path of a spec before the first import)."""
    return under(dotted, user) or any(s.admits_text(dotted, ()) for s in SLOTS.values())


def registered(dotted: str) -> bool:
    """Whether trusted code registered the function ``dotted`` for some slot (:func:`register`)."""
    return any(dotted in s.factories for s in SLOTS.values())


def register(slot_name: str, path: str) -> None:
    """Register the function at ``path`` (``"module:name"``) for ``slot_name`` (trusted code only: a spec cannot).

    A registered path may be named by a recipe whatever the allowed prefixes (trusted code vouched for it).
    ``path`` is where the function is defined (its ``__module__`` and ``__qualname__``: they are checked
    after the import, so a re-exported name is refused).

    An object slot calls it as a factory (its result checked against the slot's bases); a
    function slot hands it to the runtime (``lr_lambda``, ``step``, ``callback_hook``,
    ``loss_function``).

    Raises:
        RecipeError: an unknown slot or a path that is not ``module:name`` of public identifiers.
    """
    if slot_name not in SLOTS:
        raise RecipeError(f"register: unknown slot {slot_name!r} (known: {', '.join(sorted(SLOTS))})")
    module, _, qualname = path.partition(":")
    parts = [*module.split("."), *qualname.split(".")]
    if not qualname or not all(p.isidentifier() and not p.startswith("_") for p in parts):
        raise RecipeError(f"register: {path!r} is not 'module:name' of public identifiers")
    s = SLOTS[slot_name]
    SLOTS[slot_name] = replace(s, factories=tuple(dict.fromkeys((*s.factories, f"{module}.{qualname}"))))


# --- typing a nested keyword ---------------------------------------------------------------

#: annotations that take plain data (and markers), never a recipe
_PLAIN = (int, float, str, bool, bytes, type(None), object, type, list, dict, tuple, set, frozenset)


def parameter_slot(owner: Any, name: str) -> Slot | None:
    """The slot of ``owner``'s (a class or factory) keyword ``name``: :data:`PARAMETERS`, else its
    annotation; None: plain data only."""
    named = _named(owner, name)
    for cls in (owner.__mro__ if inspect.isclass(owner) else (owner,)):
        real = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"
        entry = PARAMETERS.get((real, name)) or (None if named else PARAMETERS.get((real, "**")))
        if entry is not None:
            return slot(entry)
    hint = _hints(owner).get(name)
    classes = tuple(dict.fromkeys(_classes_of(hint, 0))) if hint is not None else ()
    if not classes:
        return None
    homes = [h for s in SLOTS.values() if s.takes_recipe and s.bases
             and any(issubclass(c, s.classes()) for c in classes) for h in s.homes]
    names = " | ".join(f"{c.__module__}:{c.__qualname__}" for c in classes)
    return Slot(f"value of {names}", classes, tuple(dict.fromkeys(homes)))


def _named(owner: Any, name: str) -> bool:
    try:
        params = inspect.signature(owner).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind is not p.VAR_KEYWORD


def _hints(owner: Any) -> dict[str, Any]:
    target = owner.__init__ if inspect.isclass(owner) else owner
    try:
        return typing.get_type_hints(target)
    except Exception:  # annotations that do not evaluate: the keyword takes plain data
        return {}


def _classes_of(hint: Any, depth: int) -> list[type]:
    """The classes a recipe for annotation ``hint`` may subclass (through ``X | None``, ``list[X]``,
    ``Mapping[str, X]``); builtins, ``typing`` constructs and ``Callable`` give none."""
    if depth > 4:
        return []
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return [c for a in args for c in _classes_of(a, depth + 1)]
    if origin is typing.Annotated:
        return _classes_of(args[0], depth + 1) if args else []
    if origin is not None:
        if isinstance(origin, type) and issubclass(origin, Mapping):
            return _classes_of(args[-1], depth + 1) if args else []
        if isinstance(origin, type) and issubclass(origin, Iterable) and origin is not type:
            return [c for a in args if a is not Ellipsis for c in _classes_of(a, depth + 1)]
        return []  # Callable[...], type[...], Literal[...]: no recipe
    if not isinstance(hint, type) or hint in _PLAIN or hint.__module__ in ("builtins", "typing", "collections.abc"):
        return []
    if hint.__module__ == "torch" or hint.__module__.startswith("torch._"):  # Tensor, dtype, device: markers or data
        return []
    return [hint]

