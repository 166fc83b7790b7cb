"""Training diagnostics: what a run's layers did (:class:`Diagnostics`), what went wrong
(:func:`diagnose`, ``nnx-es diagnose RUN``) and where to start the learning rate (:func:`lr_find`,
``nnx-es report SPEC --lr-find``). See ``docs/guides/diagnostics.md``.

The names load on first use (PEP 562): reading a run's diagnosis does not import torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnx_es.diagnostics.findings import Diagnosis, Finding, Thresholds, diagnose
    from nnx_es.diagnostics.lr_range import LRFinder, lr_find
    from nnx_es.diagnostics.plot import plot_diagnosis
    from nnx_es.diagnostics.recorder import Diagnostics

_LAZY = {
    "Diagnostics": "nnx_es.diagnostics.recorder",
    "Diagnosis": "nnx_es.diagnostics.findings", "Finding": "nnx_es.diagnostics.findings",
    "Thresholds": "nnx_es.diagnostics.findings", "diagnose": "nnx_es.diagnostics.findings",
    "LRFinder": "nnx_es.diagnostics.lr_range", "lr_find": "nnx_es.diagnostics.lr_range",
    "plot_diagnosis": "nnx_es.diagnostics.plot",
}

__all__ = ["Diagnosis", "Diagnostics", "Finding", "LRFinder", "Thresholds", "diagnose", "lr_find", "plot_diagnosis"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nnx_es.diagnostics' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
