"""Recipes instead of pickles: rebuilding a run from import paths and constructor keywords.

* :mod:`nnx_es.recipes.slots`: the registry: what each slot of a spec may resolve to (its bases, where
  they live, registered factories), and how a nested keyword is typed;
* :mod:`nnx_es.recipes.imports`: the import guard (allowed prefixes, checks before and after importing);
* :mod:`nnx_es.recipes.core`: :class:`Recipe`, :func:`to_spec` / :func:`from_spec` / :func:`validate_recipe`;
* :mod:`nnx_es.recipes.runspec`: :class:`RunSpec`, a whole run as one JSON document, and its build.

Spec 004 "Reproducibility" describes the behaviour; the words here are our own.
"""

from nnx_es.recipes.core import BuildContext, Recipe, check_signature, from_spec, recipe_hash, to_spec, validate_recipe
from nnx_es.recipes.imports import DEFAULT_PREFIXES, Allowed, path_of
from nnx_es.recipes.slots import SLOTS, register

__all__ = [
    "DEFAULT_PREFIXES",
    "SLOTS",
    "Allowed",
    "BuildContext",
    "Recipe",
    "check_signature",
    "from_spec",
    "path_of",
    "recipe_hash",
    "register",
    "to_spec",
    "validate_recipe",
]
