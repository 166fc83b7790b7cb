"""Invariant 1 for the spec a run recorded: ``run_started.spec`` hashes to its ``spec_hash``.

A spec rewritten after it was written (the log's checksums recomputed, as a tool or a hand
could) is refused by ``nnx-es resume`` and reported here; the hash is
:func:`events.specs.spec_hash`, the one the trainer recorded. A log forged whole, spec and hash
together, replays as another run (docs/SECURITY.md).
"""

from __future__ import annotations

from events.schema import Event, RunStarted
from events.specs import spec_hash_problem
from nnx_es.audit.report import Sink

__all__ = ["SpecHashCheck"]


class SpecHashCheck:
    """Invariant 1: every ``run_started``'s spec matches its ``spec_hash``."""

    #: the kinds this check reads
    KINDS = frozenset({RunStarted.KIND})

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def feed(self, seq: int, event: Event) -> None:
        if not isinstance(event, RunStarted):
            return
        problem = spec_hash_problem(event.spec, event.spec_hash)
        if problem is not None:
            self.sink.add(seq, 1, problem, expected=event.spec_hash or "no spec_hash",
                          found="a spec that does not hash to it")
