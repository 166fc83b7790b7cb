"""The hash a ``run_started`` keeps of its spec: SHA-256 of the spec's canonical JSON (sorted keys).

One copy for the writer (``nnx_es.recipes.runspec.spec_hash``, recorded in ``run_started.spec_hash``)
and for the readers that verify it (``nnx-es resume``, ``tools/replay``). It detects a spec changed
after it was written (by hand, by a tool, with the log's checksums recomputed); a log forged
whole, spec and hash together, is another run (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

__all__ = ["RESUMABLE_SPEC_FIELDS", "canonical_hash", "spec_differences", "spec_hash", "spec_hash_problem"]

_ENCODER = msgspec.json.Encoder(order="sorted")

#: the top-level spec fields a stateful resume or a fork may change: ``epochs`` (the budget, counted
#: from the run's start for a resume, from 0 for a fork). Every other difference changes what is computed.
RESUMABLE_SPEC_FIELDS = ("epochs",)


def canonical_hash(document: Any) -> str:
    """SHA-256 (hex) of ``document``'s canonical JSON (sorted keys).

    Raises:
        TypeError: ``document`` holds a value JSON cannot encode.
    """
    try:
        return hashlib.sha256(_ENCODER.encode(document)).hexdigest()
    except (msgspec.EncodeError, OverflowError, RecursionError) as exc:
        raise TypeError(f"a spec must be JSON: {exc}") from None


def spec_hash(document: Any) -> str:
    """What ``run_started.spec_hash`` holds for ``document``: :func:`canonical_hash`, "" without a spec (None)."""
    return canonical_hash(document) if document is not None else ""


def spec_hash_problem(spec: Any, recorded: str) -> str | None:
    """Why ``spec`` (a ``run_started.spec``) does not match the ``recorded`` hash, or None when it does.

    A run without a spec records ``""``; a spec whose hash differs was changed after it was
    written (a readable message naming both hashes).
    """
    try:
        found = spec_hash(spec)
    except TypeError as exc:
        return f"run_started.spec cannot be hashed ({exc}): it was changed after it was written"
    if found == recorded:
        return None
    if spec is None:
        return (f"run_started records spec_hash {recorded[:16]}... but no spec: the spec was removed after it was "
                "written")
    return (f"run_started.spec hashes to {found[:16]}..., not to the spec_hash it records ({recorded[:16] or 'none'}"
            f"{'...' if recorded else ''}): the stored spec was changed after it was written")


def spec_differences(run: Any, given: Any, *, ignore: tuple[str, ...] = RESUMABLE_SPEC_FIELDS) -> list[str]:
    """Where spec ``given`` differs from spec ``run`` (JSON documents, e.g. a ``run_started.spec``), one line
    each, in key order: ``"optimizers.main.kwargs.lr: 0.003 in the run, 0.1 given"``. A path is its keys and
    list indices joined by dots; a key one side lacks counts as the other side's empty value (``[]``, ``{}``,
    None: a field recorded only when set). Top-level fields in ``ignore`` are not compared.
    """
    out: list[str] = []
    _diff(run, given, "", out, ignore)
    return out


def _diff(a: Any, b: Any, path: str, out: list[str], ignore: tuple[str, ...]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if not path and key in ignore:
                continue
            missing = object()
            x, y = a.get(key, missing), b.get(key, missing)
            if x is missing or y is missing:
                other = y if x is missing else x
                if other in ([], {}, None):
                    continue
            where = f"{path}.{key}" if path else str(key)
            if x is missing or y is missing:
                out.append(f"{where}: {'absent' if x is missing else _show(x)} in the run, "
                           f"{'absent' if y is missing else _show(y)} given")
            else:
                _diff(x, y, where, out, ignore)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}.{i}" if path else str(i), out, ignore)
    elif a != b or isinstance(a, bool) != isinstance(b, bool):  # true is not 1 in a spec
        out.append(f"{path or '(the spec)'}: {_show(a)} in the run, {_show(b)} given")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
