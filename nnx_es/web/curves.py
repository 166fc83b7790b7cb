"""The per-update curves of ``nnx-es serve``: each committed update's training loss, gradient norm and learning
rate, per optimizer, downsampled to a min/max envelope and read a bounded part of the log per request.

A run of ten million events holds five million updates: reading them all to answer one request took minutes.
Here a run's curves are an :class:`UpdateCurves` the server keeps in memory, and each request reads at most
``budget`` events (:data:`READ_BUDGET`) more; the answer says how much of the log is read (``parts_read`` of
``parts``, the ``read`` ranges, ``complete``) and the page asks again until it is complete, drawing what it
has. A log is append-only, so what was read stays true; a live run's curves follow its writer at the cost of
what it appended since.

**Parts, coarse to fine.** The log is cut into parts of ``part`` seqs (:data:`PART`), read in this order: the
newest part, the first, then the middle, the quarters, ... (:func:`coarse_to_fine`), so the first answer
already spans the whole run and shows its latest updates, and each later one fills the gaps. A part is
read with a committed view of its own (:class:`projections.view.Projector`, fed from the part's first seq):
which of a part's receipts are committed depends only on the LASTs and resumes after them, so the view
needs nothing from before the part; it reads on past the part's end until none of the part's receipts is
pending (up to the next LAST: about an epoch), and keeps only the part's own. A part whose receipts still
wait at the log's end (the uncommitted tail) waits there for its writer, and counts as read: what is
pending there is not drawn. So what a part reads beyond itself, and holds meanwhile, is bounded by the
run's epochs, not by the run: a run of one epoch as long as the run reads each part to that epoch's end.

**What is committed.** The committed view is fed only the receipts, the LASTs and the resumes: over those
events alone it commits the same receipts as over the whole log (:func:`nnx_es.plotting.committed_of` says
why; tested against :func:`projections.committed`). Updates a resume discarded and the uncommitted tail are
never drawn.

**Downsampling.** Each curve is an :class:`nnx_es.plotting.Envelope` of at most ``buckets``
(:data:`CURVE_BUCKETS`) buckets of ``steps_per_bucket`` consecutive steps (a power of two; bucket ``i`` holds
the steps ``s`` with ``s // steps_per_bucket == i``). A bucket is drawn as its least and its greatest value
(NaN left out), both at the mean of its steps: once the log is read, the true extremes of the committed
updates it holds, so a spike is never lost; before, the extremes of those read so far. While a run has
fewer steps than buckets, a bucket is one step: the curve is exact. The gradient-norm curve holds the
updates that computed one (``grad_norm`` not None); the learning-rate curve is each update's first group's.

Reads happen inside :meth:`nnx_es.web.reading.RunsRoot.read` (one reader of a run at a time). What one read
transaction read (:data:`READ_STEP` events at most) is folded only once it ended without a writer opening the
log meanwhile (:func:`events.log.quiet_readers`): a read the writer may have spoiled raises
:class:`~events.errors.WriterAppearedError` and is read again, never folded.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from events.codec import TYPE_CODES, partial_decoder, partial_type
from events.errors import CorruptEventError
from events.log import LmdbLog
from events.schema import LastCommitted, MicrobatchDone, RunResumed, UpdateCommitted
from nnx_es.plotting import Envelope
from projections.view import MicrobatchRequired, Projections, Projector

__all__ = ["CURVE_BUCKETS", "PART", "READ_BUDGET", "READ_STEP", "UpdateCurves", "coarse_to_fine", "finite"]

#: buckets a per-update curve keeps (each drawn as a min and a max)
CURVE_BUCKETS = 2048
#: seqs in a part of the log (the unit read in coarse-to-fine order)
PART = 1 << 16
#: most events one request reads (a part: about a quarter of a second of CPU on a 2-core machine of 2026)
READ_BUDGET = PART
#: most events one read transaction reads (held in memory until the transaction ends, then folded)
READ_STEP = 1 << 14

#: an ``update_committed`` as the curves read it: its required fields checked, the fields drawn kept
_Receipt = partial_type(UpdateCommitted, "grad_norm", "lrs", "optimizer")
_decode = partial_decoder({UpdateCommitted: _Receipt, MicrobatchDone: MicrobatchRequired})
_RECEIPT = TYPE_CODES[UpdateCommitted]
#: ``bytes.translate`` tables over type codes: the events fed to the committed view; the receipts
_FED = bytes(int(c in (_RECEIPT, TYPE_CODES[LastCommitted], TYPE_CODES[RunResumed])) for c in range(256))
_IS_RECEIPT = bytes(int(c == _RECEIPT) for c in range(256))
_STEP, _LOSS, _LRS, _GRAD_NORM, _OPTIMIZER = map(attrgetter, ("step", "loss", "lrs", "grad_norm", "optimizer"))
_FIRST = itemgetter(0)


def finite(values: Any) -> list[float | None]:
    """``values`` with each NaN, infinity or None as None (JSON has no such numbers)."""
    return [v if v is not None and math.isfinite(v) else None for v in values]


def coarse_to_fine(n: int) -> list[int]:
    """``0..n-1`` in the order parts are read: the last, the first, then each level of halving
    (``n = 8``: 7, 0, 4, 2, 6, 1, 3, 5)."""
    order = [n - 1] if n else []
    step = 1 << n.bit_length()
    while step:
        order.extend(range(0, n, step))
        step >>= 1
    return list(dict.fromkeys(order))


class _CommittedReceipts(Projector):
    """The committed view of :class:`~projections.view.Projector`, handing the receipts it commits, with their
    seqs, to ``take`` instead of folding projections."""

    __slots__ = ("take",)

    def __init__(self, take: Callable[[list[int], list[Any]], None]) -> None:
        super().__init__(Projections())
        self.take = take

    def fold(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        self.last = seqs[-1]
        marks = codes.translate(_IS_RECEIPT)
        if 1 in marks:
            self.take(list(itertools.compress(seqs, marks)), list(itertools.compress(events, marks)))


class _Part:
    """The receipts of seqs ``[start, end)``: a committed view fed from ``start`` on (``next``: the next seq
    to feed it) until none of them is pending."""

    __slots__ = ("start", "end", "next", "view")

    def __init__(self, start: int, end: int, take: Callable[[list[Any]], None]) -> None:
        self.start, self.end, self.next = start, end, start

        def own(seqs: list[int], receipts: list[Any]) -> None:
            receipts = receipts[:bisect.bisect_left(seqs, end)]
            if receipts:
                take(receipts)

        self.view = _CommittedReceipts(own)

    @property
    def done(self) -> bool:
        """Read to its end, and none of its receipts pending (each committed, or dropped by a resume)."""
        pending = self.view.pending
        return self.next >= self.end and (not pending or pending[0][0][0] >= self.end)


class UpdateCurves:
    """One run's per-update curves, read from its log a bounded part at a time (see the module docstring).

    Args:
        buckets: the most buckets a curve keeps (a positive even number).
        part: seqs in a part of the log (the unit read in coarse-to-fine order).

    Attributes:
        total: the log's length when it was last read.
        undecodable: values read that did not decode (skipped, as ``tools/inspect`` reads).
    """

    def __init__(self, buckets: int = CURVE_BUCKETS, part: int = PART) -> None:
        self.buckets, self.part = buckets, part
        self._start()

    def _start(self) -> None:
        self.envelopes: dict[str, Envelope] = {}
        self.total = 0
        self.undecodable = 0
        self._done: set[int] = set()  # parts read
        self._begun: dict[int, _Part] = {}  # parts begun and not done (reading, or waiting at the log's end)

    def _take(self, receipts: list[Any]) -> None:
        names = set(map(_OPTIMIZER, receipts))
        groups = {names.pop(): receipts} if len(names) == 1 else {n: [r for r in receipts if r.optimizer == n] for n in names}
        for opt, rs in groups.items():
            n = len(rs)
            steps = np.fromiter(map(_STEP, rs), dtype=np.int64, count=n)
            lrs = list(map(_LRS, rs))
            first_lrs = map(_FIRST, lrs) if all(lrs) else (v[0] if v else math.nan for v in lrs)
            norms = np.array(list(map(_GRAD_NORM, rs)), dtype=object)
            computed = norms != None  # noqa: E711 - elementwise: the updates that computed a gradient norm
            columns = {f"loss/{opt}": (steps, np.fromiter(map(_LOSS, rs), dtype=np.float64, count=n)),
                       f"lr/{opt}": (steps, np.fromiter(first_lrs, dtype=np.float64, count=n))}
            if computed.any():
                columns[f"grad_norm/{opt}"] = (steps[computed], norms[computed].astype(np.float64))
            for name, (xs, ys) in columns.items():
                self.envelopes.setdefault(name, Envelope(self.buckets)).add(xs, ys)

    def _parts(self) -> int:
        return -(-self.total // self.part)

    def _waiting(self, k: int) -> bool:
        """Whether part ``k`` is begun, not done, and read to the log's end (what it holds back is the tail)."""
        p = self._begun.get(k)
        return p is not None and p.next >= self.total

    def read(self, log: LmdbLog, budget: int = READ_BUDGET) -> None:
        """Read at most ``budget`` more events of ``log`` (the log read before, grown since), part by part
        in coarse-to-fine order. A log now shorter than it was (its writer took back a batch whose sync
        failed) is read again from the start.

        Raises:
            WriterAppearedError: a writer opened the log during a read transaction (what it read is not folded).
            EventLogError: LMDB refused a read.
        """
        total = log.next_seq
        if total < self.total:
            self._start()
        self.total = total
        spent = 0
        for k in coarse_to_fine(self._parts()):
            if spent >= budget:
                break
            if k in self._done or self._waiting(k):
                continue
            p = self._begun.get(k) or self._begun.setdefault(k, _Part(k * self.part, (k + 1) * self.part, self._take))
            spent += self._advance(p, log, budget - spent)
            if p.done:
                self._done.add(k)
                del self._begun[k]

    def _advance(self, p: _Part, log: LmdbLog, budget: int) -> int:
        """Feed part ``p`` up to ``budget`` events (a read transaction at a time); return how many it read."""
        read = 0
        while read < budget and p.next < self.total and not p.done:
            # up to the part's end, then on in steps growing from 1,024 until none of its receipts is pending
            step = p.end - p.next if p.next < p.end else max(1024, p.next - p.end)
            stop = min(self.total, p.next + min(step, READ_STEP, budget - read))
            chunks = list(log.read_chunks(p.next, stop))  # the read transaction has ended: fold what it read
            for first, values in chunks:
                self._feed(p, first, values)
            read += stop - p.next
            p.next = stop
        return read

    def _feed(self, p: _Part, first: int, values: list[Any]) -> None:
        try:
            events, codes = _decode(values, first)
            seqs: Sequence[int] = range(first, first + len(values))
        except CorruptEventError:
            kept: list[tuple[int, Any, int]] = []
            for seq, raw in enumerate(values, first):
                try:
                    (event,), code = _decode([raw], seq)
                    kept.append((seq, event, code[0]))
                except CorruptEventError:
                    self.undecodable += p.start <= seq < p.end
            seqs, events = [s for s, _, _ in kept], [e for _, e, _ in kept]
            codes = bytes(c for _, _, c in kept)
        fed = codes.translate(_FED)
        p.view.feed(list(itertools.compress(seqs, fed)), list(itertools.compress(events, fed)),
                    bytes(itertools.compress(codes, fed)))

    def read_ranges(self) -> list[list[int]]:
        """The seqs whose committed updates are all in the curves, as ``[first, stop)`` ranges: the parts read,
        and the parts read to the log's end."""
        spans = sorted((k * self.part, min((k + 1) * self.part, self.total)) for k in range(self._parts())
                       if k in self._done or self._waiting(k))
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        return merged

    def doc(self) -> dict[str, Any]:
        """The curves read so far: ``series`` (per name, ``x``: steps, ``y``: values, ``updates``: the committed
        updates it summarizes, ``steps_per_bucket``), ``steps_per_bucket`` (the greatest), ``buckets``,
        ``points``, and how much of the log is read:
        ``total`` (its length), ``parts`` (of ``part`` seqs), ``parts_read``, ``read`` (:meth:`read_ranges`),
        ``complete`` (every part read), ``undecodable``."""
        series: dict[str, Any] = {}
        for name, env in sorted(self.envelopes.items()):
            xs, ys = env.line()
            series[name] = {"x": xs.tolist(), "y": finite(ys.tolist()), "updates": int(env.count.sum()),
                            "steps_per_bucket": env.steps_per_bucket}
        per = max((s["steps_per_bucket"] for s in series.values()), default=1)
        n = self._parts()
        read = sum(k in self._done or self._waiting(k) for k in range(n))
        return {"series": series, "steps_per_bucket": per, "buckets": self.buckets,
                "points": sum(len(s["x"]) for s in series.values()), "total": self.total, "part": self.part,
                "parts": n, "parts_read": read, "read": self.read_ranges(), "complete": read == n,
                "undecodable": self.undecodable}
