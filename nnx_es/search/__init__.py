"""Hyper-parameter search on Optuna, each trial an audited nnx_es run that resumes bit for bit.

* :func:`search` (:mod:`nnx_es.search.run`): the search loop of one worker; several share a study;
* :mod:`nnx_es.search.space`: a space as data (``{path: {"float": [low, high], "log": true}}``);
* :mod:`nnx_es.search.pruning`: :class:`TrialPruning`, the callback reporting each epoch to the trial;
* :mod:`nnx_es.search.sampler`: :class:`TrialSeeded`, samplers seeded per trial;
* :mod:`nnx_es.search.study`: the study's directory, default storage and the workers' claims;
* :mod:`nnx_es.search.report`: :class:`SearchResult` (table, plots); :mod:`nnx_es.search.audit`:
  :func:`audit_study`, the study against its runs.

Optuna is an optional dependency (``pip install 'nnx_es[search]'``); the names load on first use,
so a run that holds a :class:`TrialPruning` resumes without it (``nnx-es resume``).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnx_es.search.audit import StudyAudit, audit_study, load_study
    from nnx_es.search.pruning import TrialPruning
    from nnx_es.search.report import SearchResult, SearchRow
    from nnx_es.search.run import search
    from nnx_es.search.sampler import TrialSeeded
    from nnx_es.search.space import parse_space

_LAZY = {
    "search": "nnx_es.search.run", "SearchResult": "nnx_es.search.report", "SearchRow": "nnx_es.search.report",
    "audit_study": "nnx_es.search.audit", "load_study": "nnx_es.search.audit", "StudyAudit": "nnx_es.search.audit",
    "TrialPruning": "nnx_es.search.pruning", "TrialSeeded": "nnx_es.search.sampler",
    "parse_space": "nnx_es.search.space",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nnx_es.search' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name == "optuna":
            raise ImportError(f"nnx_es.search.{name} needs Optuna: pip install 'nnx_es[search]'") from None
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
