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

__all__ = ["canonical_hash", "spec_hash", "spec_hash_problem"]

_ENCODER = msgspec.json.Encoder(order="sorted")


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
