"""One streaming pass that folds the committed view and measures the uncommitted tail."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from events.schema import Event, RunResumed
from projections import Projections, committed, fold

__all__ = ["CommittedFold"]


class CommittedFold:
    """Iterate ``(seq, event, projections)`` over the committed view of ``pairs``, folding as it goes.

    The committed view (:func:`projections.committed`) is not a prefix in seq
    order: a deferred LAST commits its epoch while later events stay pending.
    So the pass counts, since the last ``run_resumed``, the events read and the
    events the view has yielded; the difference is what the view holds back.

    After iteration:

    * ``p``: the projection of the whole log; ``max_seq``: the highest committed seq;
    * ``tail``: events the committed view leaves out (:func:`projections.tail_length`);
    * ``closing``: closing events a finalized tail contributed at the end, and
      ``before_closing`` the projection just before them;
    * ``restart`` / ``restart_seq``: the projection at the last point where the
      view held nothing back; folding the committed view of the events after
      ``restart_seq`` onto ``restart`` gives the same state as the whole pass.

    The input is read once; memory is what :func:`projections.committed` holds back.
    """

    def __init__(self, pairs: Iterable[tuple[int, Event]]) -> None:
        self._pairs = pairs
        self.p = Projections()
        self.before_closing = self.p
        self.restart, self.restart_seq = self.p, -1
        self.max_seq = -1
        self.last_read = -1  # seq of the last event read
        self.closing = 0
        self.read = 0  # decodable events read since the last run_resumed (it included)
        self.yielded = 0  # of those, yielded by the committed view before the input ended
        self.exhausted = False

    @property
    def tail(self) -> int:
        return self.read - self.yielded - self.closing

    def _source(self) -> Iterator[tuple[int, Event]]:
        for seq, event in self._pairs:
            if type(event) is RunResumed:  # the view drops what it held back
                self.read = self.yielded = 0
            self.read += 1
            self.last_read = seq
            yield seq, event
        self.exhausted = True

    def __iter__(self) -> Iterator[tuple[int, Event, Projections]]:
        for seq, event in committed(self._source()):
            self.p = fold(self.p, seq, event)
            self.max_seq = max(self.max_seq, seq)
            if self.exhausted:
                self.closing += 1
            else:
                self.yielded += 1
                self.before_closing = self.p
                if self.read == self.yielded:  # nothing held back: a fresh view may restart after seq
                    self.restart, self.restart_seq = self.p, seq
            yield seq, event, self.p
