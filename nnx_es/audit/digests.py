"""Invariant 11 (data parallelism) over the whole recorded sequence, in log order: every
``params_digested`` holds one digest per rank of the run (``run_started.world_size``, or an elastic
run's ``world_changed.new``), all equal,
and says so; a step never goes back; and one was recorded at every point of the declared cadence
(``run_started.digests``: every K committed updates, or each epoch's end) the run reached, and one
of the final step of a completed or stopped run. The other sequence checks: :mod:`nnx_es.audit.sequence`.

Fed ``(seq, event)`` of every decodable event; keeps O(1) state.
"""

from __future__ import annotations

from events.codec import KINDS
from events.schema import (
    DigestCadence,
    EpochSummarized,
    Event,
    HistoryAppended,
    LastCommitted,
    ParamsDigested,
    RunFinalized,
    RunResumed,
    RunStarted,
    WorldChanged,
)
from nnx_es.audit.report import Sink

__all__ = ["DigestCheck"]


class DigestCheck:
    """Invariant 11: the ranks' recorded parameter digests agree, and none due was left out (see the
    module docstring).

    The cadence is what ``run_started`` / ``run_resumed`` declare (``digests``; a run recorded before
    it was declared, or one process, is checked for agreement only): every K committed updates, a
    ``params_digested`` at each multiple of K the run reached (known from ``history_appended`` and a
    completed or stopped ``run_finalized``, not from the receipts: this check reads no hot kind); or,
    each epoch, one for the epoch before its ``epoch_summarized``. A resume counts from its LAST's step.
    A completed or stopped run's last digest is of its final step (one ``final`` after the last commit
    when the cadence's last was not).
    """

    KINDS = frozenset({"run_started", "run_resumed", "params_digested", "epoch_summarized", "history_appended",
                       "last_committed", "run_finalized", "world_changed"})

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.size = 1
        self.step = -1
        self.every: int | None = None  # the cadence in committed updates
        self.per_epoch = False  # the cadence: each epoch's end
        self.due: int | None = None  # the next step a digest is due at (every K)
        self.digested_epoch: int | None = None  # the epoch of the latest digest (per epoch)
        self.missing_epoch: int | None = None  # an epoch reported without its digest, none since
        self.last: tuple[int, int] | None = None  # the latest LAST's (seq, step): where a resume counts from
        self.last_size = 1  # the world size the latest LAST was committed at (an elastic run's changes)

    def _cadence(self, digests: DigestCadence | None, step: int) -> None:
        self.every = digests.every if digests is not None else None
        self.per_epoch = digests is not None and digests.every is None
        self.due = (step // self.every + 1) * self.every if self.every is not None else None
        self.digested_epoch = self.missing_epoch = None

    def _reached(self, seq: int, step: int, where: str) -> None:
        """The run committed ``step`` updates: every digest due up to it must be recorded by now."""
        due, every = self.due, self.every
        if due is not None and every is not None and step >= due:
            self.sink.add(seq, 11, f"no params_digested at step {due} (DDP(digest_every={every})), though {where} "
                          f"says the run reached step {step}", expected=f"params_digested(step={due})", found="none")
            self.due = (step // every + 1) * every

    def feed(self, seq: int, event: Event) -> None:
        match event:
            case RunStarted(digests=digests, world_size=size):
                self.step = -1
                self.size = size
                self.last = None
                self._cadence(digests, 0)
            case RunResumed(digests=digests, last_seq=last_seq):
                self.step = -1
                # a resume continues from the latest LAST (a deferred one included); another: agreement only
                step = self.last[1] if self.last is not None and self.last[0] == last_seq else None
                self._cadence(digests if step is not None else None, step or 0)
                if step is not None:  # the resumed checkpoint's world size, until a world_changed says otherwise
                    self.size = self.last_size
            case WorldChanged(new=new):  # an elastic run's new world size (nnx_es.distributed.resize)
                self.size = new
            case LastCommitted(counters=counters):
                self.last = (seq, counters.step)
                self.last_size = self.size
            case HistoryAppended(record=record):
                self._reached(seq, record.counters.step, f"history_appended(epoch={record.epoch})")
            case RunFinalized(status=status, steps=steps) if status in ("completed", "stopped"):
                self._reached(seq, steps, f"run_finalized(status={status!r})")
                covered = (self.every is not None and steps % self.every == 0) or self.missing_epoch is not None
                if (self.every is not None or self.per_epoch) and steps > 0 and self.step != steps and not covered:
                    self.sink.add(seq, 11, f"a {status} run's last params_digested is not of its final step {steps}: "
                                  "the replicas were not compared at the end of training",
                                  expected=f"params_digested(step={steps})",
                                  found="none" if self.step < 0 else f"step {self.step}")
            case EpochSummarized(epoch=epoch) if self.per_epoch and self.digested_epoch != epoch:
                self.missing_epoch = epoch  # reported here: not again at the run's end
                self.sink.add(seq, 11, f"no params_digested for epoch {epoch} before its epoch_summarized (the ranks "
                              "compare digests at each epoch's end)", expected=f"params_digested(epoch={epoch})",
                              found="none" if self.digested_epoch is None else f"epoch {self.digested_epoch}")
            case ParamsDigested(epoch=epoch, step=step, digests=digests, diverged=diverged, final=final):
                apart = sorted(r for r, d in enumerate(digests) if d != digests[0])
                if apart or diverged:
                    self.sink.add(seq, 11, f"the ranks' parameters differ at step {step}: rank(s) {apart} "
                                  "disagree with rank 0" if apart else f"params_digested at step {step} says "
                                  "the ranks disagree", expected="equal digests", found=digests)
                if len(digests) < 2:
                    self.sink.add(seq, 11, "params_digested with fewer than 2 ranks' digests",
                                  expected=">= 2 digests", found=len(digests))
                elif self.size > 1 and len(digests) != self.size:
                    self.sink.add(seq, 11, f"params_digested holds {len(digests)} digests in a run of {self.size} ranks",
                                  expected=f"{self.size} digests", found=len(digests))
                if step < self.step:
                    self.sink.add(seq, 11, "params_digested goes back in steps", expected=f">= {self.step}",
                                  found=step)
                self.step = step
                self.digested_epoch = epoch
                self.missing_epoch = None
                if self.due is not None and self.every is not None:
                    if step % self.every and not final:  # the end of training's may fall anywhere
                        self.sink.add(seq, 11, f"params_digested at step {step}, off the cadence (DDP(digest_every="
                                      f"{self.every}): multiples of {self.every})", expected=f"step {self.due}",
                                      found=step)
                    else:
                        self._reached(seq, step - 1, f"params_digested(step={step})")
                        if step >= self.due:
                            self.due = (step // self.every + 1) * self.every
            case _:
                pass
