"""A griffe extension for the API reference: the docstrings' Sphinx roles as code.

The code's docstrings cite other objects the Sphinx way (``:class:`~nnx_es.monitor.Monitor```,
``:mod:`nnx_es.rows```, ``:func:`...```), which Markdown would print as written. Each role becomes
a code span of its target (the last name when the target starts with ``~``, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRolesAsCode(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring as a Markdown code span."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
