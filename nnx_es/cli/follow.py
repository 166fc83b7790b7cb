"""``inspect RUN_DIR export --tensorboard DIR --follow``: keep exporting a live run's committed scalars.

The export reads the log read-only beside its writer, polling it every ``poll_s`` seconds
(bounded: :data:`MAX_POLL_S`), and passes every value through one committed view
(:func:`projections.committed`) for the whole follow, so each committed event is written
once, when the LAST that commits it is read, and an uncommitted tail never is. The scalars
and their tags are the one-shot export's (:func:`nnx_es.sinks.scalars_of`, written by
:class:`nnx_es.sinks.TensorBoardSink`). It stops when the log read so far ends
with a ``run_finalized`` (then the closing events are folded, as every reader does; an earlier
session's, which a resume continued, does not end the follow), when no
process on this machine holds the run's writer lease and nothing new was written (a killed
writer: said on stderr), or on Ctrl-C (``KeyboardInterrupt`` propagates to the CLI: exit 130,
what was written so far is closed and kept). Memory: what the committed view holds back
(about one epoch) and one chunk of values.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

from events.codec import decode_many
from events.log import LmdbLog
from events.schema import Event, RunFinalized
from nnx_es.cli._common import open_log, writer_alive
from nnx_es.sinks import TensorBoardSink, scalars_of
from projections.commits import AFTER_RUN_KINDS
from projections.view import committed

__all__ = ["MAX_POLL_S", "follow_tensorboard"]

#: the longest wait between two polls of the log, in seconds
MAX_POLL_S = 5.0


def _live_events(log: LmdbLog, run_dir: Path, poll_s: float, said: list[str]) -> Iterator[tuple[int, Event]]:
    """The log's events in seq order, polled as the writer appends them, until the run's ``run_finalized``
    or a writer that is gone; why it ended is appended to ``said``."""
    next_seq = 0
    finalized = False  # the events read so far end with a run_finalized (evaluations after it aside)
    while True:
        alive = writer_alive(run_dir)  # read before the log: a writer that flushed, then died, is seen
        end = log.refresh()
        if end > next_seq:
            for first, values in log.read_chunks(next_seq, end):
                for pair in zip(range(first, first + len(values)), decode_many(values, first)):
                    yield pair
                    if type(pair[1]) is RunFinalized:
                        finalized = True
                    elif pair[1].KIND not in AFTER_RUN_KINDS:  # a resumed session goes on after it
                        finalized = False
                next_seq = first + len(values)
            if finalized:
                said.append("finalized")
                return
        elif not alive:
            said.append("writer gone")
            return
        time.sleep(poll_s)


def follow_tensorboard(run_dir: Path, out_dir: Path, poll_s: float = 0.5) -> int:
    """Export ``run_dir``'s committed scalars to TensorBoard in ``out_dir``, following the live run
    (see the module docstring); return how many scalars were written.

    Raises:
        ValueError: ``poll_s`` is not in (0, :data:`MAX_POLL_S`].
        EventLogError / CorruptEventError: the log cannot be read, or a value does not decode (named).
        NotARunError: ``run_dir`` holds no event log.
        KeyboardInterrupt: Ctrl-C (the event file written so far is closed first).
    """
    if not 0 < poll_s <= MAX_POLL_S:
        raise ValueError(f"poll_s={poll_s!r}: expected seconds in (0, {MAX_POLL_S}]")
    said: list[str] = []
    sink = TensorBoardSink(out_dir)
    written = 0
    with open_log(Path(run_dir), follow=True, poll_s=poll_s) as log:  # a run starting now is waited for
        sink.open(Path(run_dir))
        try:
            for seq, event in committed(_live_events(log, Path(run_dir), poll_s, said)):
                n = len(scalars_of(event))
                if n:
                    sink.write(seq, event)
                    written += n
        finally:
            sink.close()
    if said == ["writer gone"]:
        print(f"inspect: no process writes {run_dir} any more and it is not finalized; stopped following",
              file=sys.stderr)
    return written
