"""Resolving a recipe's dotted path to an object, under module prefixes that trusted code allows.

A recipe names what to build as ``"package.module:Qualified.name"`` (or the plain dotted
form ``"package.module.name"``). Rebuilding it is an import, so it is guarded twice:

1. **before importing**, from the text alone: every part is an identifier, none is private
   (a leading ``_``), the path lies under one of the allowed prefixes (``torch``, ``nnx_es``
   and what the trusted caller adds -- never what a recipe asks for) and under none of the
   denied ones (torch's own code loaders and process spawners, nnx_es's crash harness);
2. **after importing**, from the object itself: it is a class or a function, its
   ``__module__`` is allowed (an alias such as ``logging.os.system`` resolves to ``posix`` and
   is refused) and its ``__qualname__`` is public and not local (``<lambda>``, ``<locals>``).

A refused path raises :class:`~nnx_es.errors.UnsafeRecipeError` naming it; in case 1 nothing
was imported. See spec 004 "Reproducibility" (recipes instead of pickles).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

from nnx_es.errors import RecipeError, UnsafeRecipeError

__all__ = ["DEFAULT_PREFIXES", "DENIED_PREFIXES", "Allowed", "path_of"]

#: what a recipe may name unless trusted code allows more
DEFAULT_PREFIXES = ("torch", "nnx_es")
#: never, whatever is allowed: code loaders, process spawners, the crash harness
DENIED_PREFIXES = (
    "torch.hub", "torch.serialization", "torch.load", "torch.package", "torch.jit", "torch.utils.cpp_extension",
    "torch.multiprocessing", "torch.distributed", "torch.onnx", "torch.compiler", "torch.utils.benchmark",
    "nnx_es.testing", "nnx_es.injection", "nnx_es.cli",
)


def _under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or inside one (``torchvision`` is not under ``torch``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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

    Args:
        extra: further prefixes, e.g. the package that defined the model (``"myproject"``).

    Raises:
        RecipeError: a prefix that is not a dotted identifier.
    """

    def __init__(self, extra: Iterable[str] = (), *, defaults: Iterable[str] = DEFAULT_PREFIXES) -> None:
        prefixes = [*defaults, *extra]
        for p in prefixes:
            if not isinstance(p, str) or not all(part.isidentifier() for part in p.split(".")):
                raise RecipeError(f"an allowed module prefix must be a dotted name, got {p!r}")
        self.prefixes = tuple(dict.fromkeys(prefixes))

    def __repr__(self) -> str:
        return f"Allowed({', '.join(self.prefixes)})"

    def with_module_of(self, obj: Any) -> Allowed:
        """These prefixes plus the top-level package that defined ``obj``'s class (trusted: the
        caller holds the object)."""
        module = type(obj).__module__.split(".")[0]
        if module in ("builtins", "__main__"):
            return self
        return Allowed((module,), defaults=self.prefixes)

    def check_text(self, path: str) -> tuple[str, str]:
        """Check ``path`` before anything is imported; return (module, qualname or "").

        Raises:
            UnsafeRecipeError: malformed, private, denied or outside the allowed prefixes.
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
        if _under(dotted, DENIED_PREFIXES):
            raise UnsafeRecipeError(f"recipe path {path!r} is under a denied module (code loaders, process "
                                    "spawners); refused, nothing imported")
        if not _under(dotted, self.prefixes):
            raise UnsafeRecipeError(
                f"recipe path {path!r} is outside the allowed module prefixes {list(self.prefixes)}; refused, "
                "nothing imported (trusted code may allow more, e.g. --allow PACKAGE; a recipe cannot)"
            )
        return module, qualname

    def resolve(self, path: str) -> Any:
        """Import the class or function ``path`` names, after checking the text, and check what it is.

        Raises:
            UnsafeRecipeError: see :meth:`check_text`; or the object resolves to a module outside the
                allowed prefixes, a denied one, or a private/local name (an alias).
            RecipeError: the path does not import or names no class or function.
        """
        module, qualname = self.check_text(path)
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
        if (not _under(real_module, self.prefixes) or _under(real, DENIED_PREFIXES)
                or any(p.startswith(("_", "<")) for p in [*real_module.split("."), *real_qualname.split(".")])):
            raise UnsafeRecipeError(
                f"recipe path {path!r} resolves to {real!r}, outside the allowed module prefixes "
                f"{list(self.prefixes)} or private (an alias); refused"
            )
        return obj

    @staticmethod
    def _import(module: str, path: str) -> Any:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise RecipeError(f"recipe path {path!r} does not import: {exc}") from None
