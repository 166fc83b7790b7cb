"""Training diagnostics (``docs/guides/diagnostics.md``), public as ``nnx_es.Diagnostics``,
``nnx_es.diagnose`` and ``nnx_es.lr_find``:

* :mod:`nnx_es.diagnostics.recorder`: ``Diagnostics(every=N)``, what a run's layers did;
* :mod:`nnx_es.diagnostics.findings`: ``diagnose(run_dir)`` (``nnx-es diagnose RUN``), what went wrong,
  its ``Thresholds``; :mod:`nnx_es.diagnostics.plot` draws it;
* :mod:`nnx_es.diagnostics.lr_range`: ``lr_find(...)`` (``nnx-es report SPEC --lr-find``), where to start
  the learning rate.

Nothing is imported here: reading a run's diagnosis does not import torch.
"""

__all__: list[str] = []
