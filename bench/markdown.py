"""Writing one generated section of BENCHMARKS.md without touching the rest of the file.

Each generator (``bench.run``, ``bench.ddp``) owns the region between
``<!-- begin NAME -->`` and ``<!-- end NAME -->``; :func:`write_section` replaces that region,
or appends it when the file has none, so the hand-written sections beside it (issue notes, the
scale and journal figures) survive a new ``make bench``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_section"]

HEADER = "# Benchmarks\n\nProduced by `make bench` (`python -m bench.run`).\n"


def write_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` in ``path``'s region named ``name`` (created after the rest when absent)."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    old = path.read_text() if path.exists() else HEADER
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)
