"""MkDocs hook: the nav sections whose pages are found rather than listed.

* "How-to guides": mkdocs.yml lists the guides in their reading order; a page under
  docs/guides/ not listed there is appended by itself (sorted by file name, titled by its
  first ``# `` heading), so a new guide needs no edit of mkdocs.yml to appear.
* "Python API": the generated API pages (``api_pages.api_pages()``, from the code's ``__all__``)
  follow the section's overview page.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_pages import api_pages  # noqa: E402

GUIDES = "How-to guides"
API = "Python API"


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("-", " ").capitalize()


def _sections(nav: list[Any]) -> dict[str, list[Any]]:
    """Every section of the nav (nested ones too) by title."""
    found: dict[str, list[Any]] = {}
    for item in nav:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, list):
                    found[title] = value
                    found.update(_sections(value))
    return found


def _paths(entries: list[Any]) -> set[str]:
    return {next(iter(e.values())) if isinstance(e, dict) else e for e in entries}


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    sections = _sections(config["nav"] or [])
    guides = sections[GUIDES]
    listed = _paths(guides)
    guides.extend({_title(p): p.relative_to(docs).as_posix()} for p in sorted((docs / "guides").glob("*.md"))
                  if p.relative_to(docs).as_posix() not in listed)
    api = sections[API]
    listed = _paths(api)
    api.extend({page.title: page.path} for page in api_pages() if page.path not in listed)
    return config
