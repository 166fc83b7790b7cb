"""Resolving a recipe's dotted path to an object, under module prefixes that trusted code allows.

A recipe names what to build as ``"package.module:Qualified.name"`` (or the plain dotted
form ``"package.module.name"``). Rebuilding it is an import, so it is guarded twice:

1. **before importing**, from the text alone: every part is an identifier, none is private
   (a leading ``_``), the path lies under one of the allowed prefixes (``torch``, ``nnx_es``
   and the user's own packages the trusted caller adds -- never what a recipe asks for),
   under none of the denied ones (torch's own code loaders and process spawners, nnx_es's
   crash harness), and where the slot it stands in keeps its types
   (:class:`~nnx_es.recipes.slots.Slot`: ``torch.optim`` for an optimizer ...);
2. **after importing**, from the object itself: it is a class or a function, its
   ``__module__`` is allowed (an alias such as ``logging.os.system`` resolves to ``posix`` and
   is refused), its ``__qualname__`` is public and not local (``<lambda>``, ``<locals>``), and
   it is of the slot: a subclass of its bases, or a function registered for it (or the user's).

A refused path raises :class:`~nnx_es.errors.UnsafeRecipeError` naming it; in case 1 nothing
was imported. See spec 004 "Reproducibility" (recipes instead of pickles).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nnx_es.errors import RecipeError, UnsafeRecipeError
from nnx_es.recipes.slots import registered
from nnx_es.recipes.slots import under

if TYPE_CHECKING:
    from nnx_es.recipes.slots import Slot

__all__ = ["DEFAULT_PREFIXES", "DENIED_PREFIXES", "Allowed", "path_of"]

#: what a recipe may name unless trusted code allows more
DEFAULT_PREFIXES = ("torch", "nnx_es")
#: never, whatever is allowed: code loaders, process spawners, the crash harness
DENIED_PREFIXES = (
    "torch.hub", "torch.serialization", "torch.load", "torch.package", "torch.jit", "torch.utils.cpp_extension",
    "torch.multiprocessing", "torch.distributed", "torch.onnx", "torch.compiler", "torch.utils.benchmark",
    "nnx_es.testing", "nnx_es.injection", "nnx_es.cli",
)


def path_of(obj: Any) -> str:
    """The recipe path of a class or function: ``"module:qualname"``.

    Raises:
        RecipeError: ``obj`` is a lambda, a local function or class, or has no module.
    """
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise RecipeError(f"{obj!r} has no importable path (no __module__/__qualname__)")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise RecipeError(f"{module}.{qualname} is a lambda or a local function/class: a recipe records an "
                          "import path; define it at a module's top level")
    if module == "__main__":
        raise RecipeError(f"{qualname} is defined in the __main__ script: a recipe records an import path; "
                          "move it into an importable module")
    return f"{module}:{qualname}"


class Allowed:
    """The module prefixes a recipe may name (set by trusted code: defaults plus ``extra``).

    Inside the defaults (``torch``, ``nnx_es``) a recipe reaches only what its slot's registry
    lists (:mod:`nnx_es.recipes.slots`); inside ``extra`` -- the user's own packages, ``--allow``
    -- any class of the slot's bases, and functions (a factory, a step function, a hook).

    Args:
        extra: the user's own packages, e.g. the one that defined the model (``"myproject"``).

    Raises:
        RecipeError: a prefix that is not a dotted identifier, or an ``extra`` inside the defaults
            (``--allow torch`` would make every function of torch a factory).
    """

    def __init__(self, extra: Iterable[str] = (), *, defaults: Iterable[str] = DEFAULT_PREFIXES) -> None:
        defaults, extra = tuple(defaults), tuple(extra)
        for p in (*defaults, *extra):
            if not isinstance(p, str) or not all(part.isidentifier() for part in p.split(".")):
                raise RecipeError(f"an allowed module prefix must be a dotted name, got {p!r}")
        inside = [p for p in extra if under(p, DEFAULT_PREFIXES) or under(p, DENIED_PREFIXES)]
        if inside:
            raise RecipeError(f"--allow {inside[0]!r}: torch and nnx_es are allowed already, by type (a class of the "
                              "slot's base, or a factory registered for it); --allow names your own package")
        self.defaults = defaults
        #: the user's own packages: their classes (type-checked) and functions may be named
        self.user = tuple(dict.fromkeys(p for p in extra if p not in defaults))
        self.prefixes = tuple(dict.fromkeys((*defaults, *extra)))

    def __repr__(self) -> str:
        return f"Allowed({', '.join(self.prefixes)})"

    def with_module_of(self, obj: Any) -> Allowed:
        """These prefixes plus the top-level package that defined ``obj``'s class (trusted: the
        caller holds the object)."""
        module = type(obj).__module__.split(".")[0]
        if module in ("builtins", "__main__") or under(module, self.defaults) or under(module, DEFAULT_PREFIXES):
            return self
        return Allowed((*self.user, module), defaults=self.defaults)

    def check_text(self, path: str, slot: Slot | None = None) -> tuple[str, str]:
        """Check ``path`` before anything is imported (against ``slot`` when given); return (module, qualname or "").

        Raises:
            UnsafeRecipeError: malformed, private, denied, outside the allowed prefixes, or not where
                ``slot``'s types live.
        """
        if not isinstance(path, str) or path.count(":") > 1:
            raise UnsafeRecipeError(f"recipe path {path!r} is not 'module:name' or a dotted name")
        module, _, qualname = path.partition(":")
        parts = [*module.split("."), *(qualname.split(".") if qualname else [])]
        if not all(p.isidentifier() for p in parts):
            raise UnsafeRecipeError(f"recipe path {path!r} is not a dotted name of identifiers")
        private = [p for p in parts if p.startswith("_")]
        if private:
            raise UnsafeRecipeError(f"recipe path {path!r} names the private name {private[0]!r}; refused, nothing imported")
        dotted = module + ("." + qualname if qualname else "")
        if under(dotted, DENIED_PREFIXES):
            raise UnsafeRecipeError(f"recipe path {path!r} is under a denied module (code loaders, process "
                                    "spawners); refused, nothing imported")
        if not under(dotted, self.prefixes) and not registered(dotted):
            raise UnsafeRecipeError(
                f"recipe path {path!r} is outside the allowed module prefixes {list(self.prefixes)}; refused, "
                "nothing imported (trusted code may allow more, e.g. --allow PACKAGE; a recipe cannot)"
            )
        if slot is not None:
            slot.check_text(path, dotted, self.user)
        return module, qualname

    def resolve(self, path: str, slot: Slot | None = None) -> Any:
        """Import the class or function ``path`` names, after checking the text, and check what it is
        (against ``slot`` when given: every recipe of a spec is resolved for its slot).

        Raises:
            UnsafeRecipeError: see :meth:`check_text`; or the object resolves to a module outside the
                allowed prefixes, a denied one, or a private/local name (an alias); or it is not of ``slot``.
            RecipeError: the path does not import or names no class or function.
        """
        module, qualname = self.check_text(path, slot)
        if qualname:
            obj = self._import(module, path)
            attrs = qualname.split(".")
        else:  # the dotted form: the longest importable module, then attributes
            parts = module.split(".")
            obj, attrs = None, []
            for cut in range(len(parts) - 1, 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                attrs = parts[cut:]
                break
            if obj is None:
                raise RecipeError(f"recipe path {path!r} does not import")
        for attr in attrs:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise RecipeError(f"recipe path {path!r} does not import: no attribute {attr!r}") from None
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            raise RecipeError(f"recipe path {path!r} names {type(obj).__name__}, not a class or a function")
        real_module = getattr(obj, "__module__", None) or ""
        real_qualname = getattr(obj, "__qualname__", None) or ""
        real = f"{real_module}.{real_qualname}"
        if ((not under(real_module, self.prefixes) and not registered(real)) or under(real, DENIED_PREFIXES)
                or any(p.startswith(("_", "<")) for p in [*real_module.split("."), *real_qualname.split(".")])):
            raise UnsafeRecipeError(
                f"recipe path {path!r} resolves to {real!r}, outside the allowed module prefixes "
                f"{list(self.prefixes)} or private (an alias); refused"
            )
        if slot is not None:
            slot.check_object(obj, path, real, self.user)
        return obj

    @staticmethod
    def _import(module: str, path: str) -> Any:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise RecipeError(f"recipe path {path!r} does not import: {exc}") from None
