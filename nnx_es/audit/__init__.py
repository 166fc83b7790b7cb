"""The audit behind ``tools/replay``: check a recorded run against the eleven invariants of docs/INVARIANTS.md.

Modules: :mod:`~nnx_es.audit.report` (what an audit returns),
:mod:`~nnx_es.audit.sequence` (checks over the whole sequence: 2, 3, 7's early
stopping, 8), :mod:`~nnx_es.audit.committed` (checks over the committed view:
4, 6, 7, 10), :mod:`~nnx_es.audit.fold` (the committed view folded in one pass, with
its tail), :mod:`~nnx_es.audit.run` (the streaming pass, 1, 5 and 9), :mod:`~nnx_es.audit.reading`
(the log opened read-only, its decodable events, its uncommitted tail read from the end),
:mod:`~nnx_es.audit.snapshots` (the projections folded from the newest usable snapshot).
"""

from nnx_es.audit.fold import CommittedFold
from nnx_es.audit.report import INVARIANTS, AuditReport, NotARunError, Violation
from nnx_es.audit.reading import committed_tail, decoded, log_damage, open_run_log
from nnx_es.audit.run import audit_run
from nnx_es.audit.snapshots import Projected, project_log

__all__ = [
    "INVARIANTS",
    "AuditReport",
    "CommittedFold",
    "NotARunError",
    "Projected",
    "Violation",
    "audit_run",
    "committed_tail",
    "decoded",
    "log_damage",
    "open_run_log",
    "project_log",
]
