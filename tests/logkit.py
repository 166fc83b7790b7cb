"""Random event logs for property tests of what reads the committed view (hypothesis).

A log is a list of blocks: single events (microbatches, receipts of today's and the
legacy version, history records, checkpoints, epochs; a LAST whose ``covers`` is -1
or a seq shortly before it; a resume), LASTs followed by a commit group, and
optionally a closing ending (stop, failure, callback finalization, then
``run_finalized``): deferred commits, discarded ranges and finalized tails all occur.
"""

from __future__ import annotations

from hypothesis import strategies as st

from events.log import MemoryLog
from events.schema import (
    BestCommitted,
    CallbackFinalized,
    CheckpointStored,
    Counters,
    EpochBegan,
    Event,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    PhaseCommitted,
    RunFailed,
    RunFinalized,
    RunResumed,
    StopRequested,
    UpdateCommitted,
    UpdateCommittedV1,
)

__all__ = ["logs", "memory_log"]

_M = "a" * 64


def _event(kind: str, i: int, x: int) -> Event:
    """Event number ``i`` of a log; ``x`` (0..8) varies its fields."""
    match kind:
        case "microbatch":
            return MicrobatchDone(epoch=0, batch=i, rows=4, examples=4.0, loss=0.5)
        case "receipt":
            return UpdateCommitted(step=i, epoch=0, microbatches=1, local_examples=4.0, global_examples=4.0,
                                   loss=i / 7, grad_norm=None if x % 3 == 0 else x / 2,
                                   lrs=[] if x % 4 == 0 else [0.1 * x], optimizer="adam" if x % 2 else "sgd")
        case "legacy receipt":
            return UpdateCommittedV1(step=i, epoch=0, microbatches=1, examples=4.0, loss=i / 5, lr=0.01 * x)
        case "history":
            return HistoryAppended(record=HistoryRecord(epoch=i, train={"loss": x / 3}, val={}))
        case "checkpoint":
            return CheckpointStored(manifest=_M, epoch=0, step=i, components={"model": _M})
        case "epoch":
            return EpochBegan(epoch=x)
        case "last":
            return LastCommitted(manifest=_M, epoch=0, step=i, counters=Counters(),
                                 covers=-1 if x % 3 == 0 else max(i - x, 0))
        case "best":
            return BestCommitted(manifest=_M, epoch=0, monitor="val_loss", value=0.1)
        case "phase":
            return PhaseCommitted(name="p", manifest=_M, epoch=0)
        case "resume":
            return RunResumed(last_seq=0, manifest=_M, epoch=0, discard_from=0, discard_to=0)
        case "stop":
            return StopRequested(epoch=0, step=0, reason="requested")
        case "failed":
            return RunFailed(error_type="E", message="m", epoch=0, step=0)
        case "callback":
            return CallbackFinalized(name="cb", index=0)
        case "finalized":
            return RunFinalized(status="stopped", epochs=1, steps=1)
    raise ValueError(f"kind: unknown {kind!r}")


# the frequent kinds weigh more, as in real logs; LASTs often enough to commit and defer
_one = st.sampled_from(["microbatch", "receipt", "receipt", "legacy receipt", "history", "checkpoint", "epoch",
                        "last", "last", "resume"]).map(lambda k: [k])
_commit = st.lists(st.sampled_from(["best", "phase", "checkpoint"]), max_size=3).map(lambda g: ["last", *g])
_ending = st.lists(st.sampled_from(["stop", "failed", "callback", "microbatch"]), max_size=3).map(
    lambda closing: [*closing, "finalized"]
)


@st.composite
def _logs(draw: st.DrawFn) -> list[tuple[int, Event]]:
    blocks = draw(st.lists(st.one_of(_one, _one, _one, _commit), max_size=60))
    kinds = [k for block in blocks for k in block] + (draw(_ending) if draw(st.booleans()) else [])
    return [(i, _event(k, i, draw(st.integers(0, 8)))) for i, k in enumerate(kinds)]


#: ``[(seq, event), ...]`` from seq 0
logs = _logs()


def memory_log(pairs: list[tuple[int, Event]]) -> MemoryLog:
    """A flushed :class:`~events.log.MemoryLog` holding ``pairs``' events."""
    log = MemoryLog()
    for _, event in pairs:
        log.append(event)
    log.flush()
    return log
