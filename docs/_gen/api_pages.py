"""Which pages the Python API reference has: derived from the code's ``__all__``.

* one page per module defining a name of ``nnx_es.__all__`` (the names ``from nnx_es import``
  gives), listing those names -- a name added to ``nnx_es.__all__`` appears by itself;
* one page per public subpackage below (``SUBPACKAGES``), listing its ``__all__``.

Shared by the page generator (``reference.py``) and the nav hook (``nav.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

#: public packages documented whole (their ``__all__``), beside the top-level names
SUBPACKAGES = (
    "nnx_es.distributed", "nnx_es.testing", "nnx_es.recipes", "nnx_es.sinks", "nnx_es.logs", "nnx_es.decisions",
    "nnx_es.rows.dynamics", "nnx_es.storage", "events", "projections",
)


@dataclass(frozen=True)
class ApiPage:
    module: str  # the module rendered
    members: tuple[str, ...]  # its names shown (in __all__ order)
    title: str

    @property
    def path(self) -> str:
        return f"reference/api/{self.module}.md"


def api_pages() -> list[ApiPage]:
    """The API pages in nav order: the top-level names by defining module, then the subpackages."""
    import nnx_es

    by_module: dict[str, list[str]] = {}
    for name in nnx_es.__all__:
        by_module.setdefault(getattr(nnx_es, name).__module__, []).append(name)
    pages = [ApiPage(m, tuple(names), m) for m, names in sorted(by_module.items())]
    pages += [ApiPage(m, tuple(importlib.import_module(m).__all__), m) for m in SUBPACKAGES]
    return pages
