"""The mutable state of one run in progress, in one object that is passed down.

The session opener (:func:`nnx_es.runtime.session.open_session`) makes a :class:`RunState`;
the run's scope (:mod:`nnx_es.runtime.scope`) hands it to each collaborator that needs it (the
committer, finalization, the loop, the context). It holds:

* the run's identity and storage: ``run_id``, ``run_dir``, ``runs_root``, the
  :class:`~nnx_es.runtime.recording.Recorder` and the :class:`~nnx_es.storage.BlobStore`;
* the stop requests: :meth:`RunState.request_stop` is the one way to stop after an epoch, for
  callbacks, hooks and the loop alike (the first request wins); :meth:`RunState.stop_at_update`
  stops at the next update boundary;
* the :class:`World`: which rank this process is, of how many, and which rank writes.

Seams: STYLE.md "Seams"; torchtnt's ``State`` with its public ``stop()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from events.schema import StopRequested

if TYPE_CHECKING:
    from nnx_es.runtime.recording import Recorder
    from nnx_es.storage import BlobStore

__all__ = ["RunState", "World"]

#: the byte frame of :meth:`World.gather` (the same on every rank: it only grows, from gathered sizes)
_FRAME = [1 << 15]


@dataclass(frozen=True)
class World:
    """The process group this run trains in: ``rank`` of ``size`` ranks; ``writer_rank`` alone
    holds the lease, appends to the log and writes blobs. A single process is rank 0 of 1.

    Every collective of the runtime goes through this object (DESIGN.md "Seams"): its
    agreement primitives return the same answer on every rank, and cost nothing for one
    process (no ``torch.distributed`` call is made then).

    ``device``: where collective tensors live (``cpu`` for gloo, ``cuda:LOCAL_RANK`` for nccl).
    """

    rank: int = 0
    size: int = 1
    writer_rank: int = 0
    device: str = "cpu"

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank

    @property
    def distributed(self) -> bool:
        """More than one rank: the agreement primitives reach the process group."""
        return self.size > 1

    def agree(self, tensor: Any, op: str = "sum") -> Any:
        """All-reduce ``tensor`` in place with ``op`` (``"sum"``, ``"max"``, ``"min"``) and return it:
        every rank holds the same values after the call. One process: returned unchanged.

        ``tensor``: any shape; moved to :attr:`device` for the collective and back.
        """
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if tensor.device.type != self.device.split(":")[0]:
            moved = tensor.to(self.device)
            dist.all_reduce(moved, op=ops[op])
            tensor.copy_(moved)
        else:
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def agree_flag(self, flag: bool) -> bool:
        """Whether ``flag`` holds on ANY rank (one all-reduce of a max): a decision every rank takes alike."""
        if self.size == 1:
            return bool(flag)
        import torch

        return bool(self.agree(torch.tensor([1.0 if flag else 0.0], dtype=torch.float64), "max").item())

    def gather_tensor(self, tensor: Any) -> list[Any]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order, on every rank:
        one all-gather, no pickling. One process: ``[tensor]``."""
        if self.size == 1:
            return [tensor]
        import torch
        import torch.distributed as dist

        t = tensor.to(self.device)
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t)
        return [o.cpu() for o in out]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable builtins), in rank order, on every rank. One process: ``[obj]``.

        ONE all-gather of fixed-size byte frames (``torch.distributed.all_gather_object`` takes two:
        the sizes, then the padded objects): each rank sends an 8-byte length and its pickle padded
        to the frame size every rank holds alike (:data:`_FRAME`, grown to the largest pickle seen);
        when some pickle did not fit, every rank sees it in the lengths and all gather again in a
        frame that fits (the same decision on every rank: the lengths are gathered)."""
        if self.size == 1:
            return [obj]
        import pickle

        import torch
        import torch.distributed as dist

        payload = pickle.dumps(obj)
        n = len(payload)
        while True:
            frame = _FRAME[0]
            buf = torch.zeros(8 + frame, dtype=torch.uint8)
            buf[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
            if n <= frame:
                buf[8:8 + n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            t = buf.to(self.device)
            out = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(out, t)
            frames = [o.cpu().numpy().tobytes() for o in out]
            sizes = [int.from_bytes(f[:8], "little") for f in frames]
            if max(sizes) <= frame:
                return [pickle.loads(f[8:8 + k]) for f, k in zip(frames, sizes)]  # noqa: S301 - the group's own ranks
            _FRAME[0] = 1 << (max(sizes) - 1).bit_length()  # every rank grows it alike, then gathers again

    def share(self, obj: Any) -> Any:
        """The writer's ``obj`` on every rank (others pass anything, e.g. ``None``). One process: ``obj``."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_writer else None]
        dist.broadcast_object_list(box, src=self.writer_rank)
        return box[0]


class RunState:
    """One run in progress: identity, recorder, store, stop requests, world.

    Args:
        run_id / runs_root: the run is ``runs_root / run_id``.
        recorder: checks, appends and folds the run's events.
        store: the run's checkpoint blob store.
        world: the process group (default: one process).
    """

    def __init__(self, *, run_id: str, runs_root: Path, recorder: Recorder, store: BlobStore,
                 world: World | None = None) -> None:
        self.run_id = run_id
        self.runs_root = Path(runs_root)
        self.run_dir = self.runs_root / run_id
        self.recorder = recorder
        self.store = store
        self.world = world or World()
        self.stop_at_update_requested = False
        self._stop: tuple[str, str] | None = None

    # --- the stop request ---------------------------------------------------------------

    def request_stop(self, reason: str = "requested", by: str = "") -> None:
        """Ask the run to stop after the current epoch commits (the first request wins).

        ``reason``: recorded in ``stop_requested`` (e.g. ``"early_stopping"``); ``by``: who asked.
        """
        if self._stop is None:
            self._stop = (str(reason), str(by))

    def stop_at_update(self) -> None:
        """Stop right after the current (or next) committed update.

        Raises:
            ConfigError: under data parallelism (a stop at an update boundary is not agreed between
                the ranks; :meth:`request_stop` is decided once for all at the epoch's end).
        """
        if self.world.distributed:
            from nnx_es.errors import ConfigError

            raise ConfigError("stop_at_update() is not agreed between the ranks under distributed=DDP(): use "
                              "ctx.request_stop(reason), which stops every rank after the epoch commits")
        self.stop_at_update_requested = True

    def agree_stop(self) -> None:
        """Decide the stop request once for every rank (agreement point 2): one all-gather of each
        rank's request (after one all-reduce saying whether any rank asked); the first in rank order
        wins on every rank. Never a barrier plus a rank-local flag (that is how early stopping hangs
        a group). One process: nothing."""
        if not self.world.distributed:
            return
        if not self.world.agree_flag(self._stop is not None):  # one all-reduce; the reasons only when asked
            return
        asked = [r for r in self.world.gather(self._stop) if r is not None]
        self._stop = (str(asked[0][0]), str(asked[0][1])) if asked else None

    @property
    def stop_requested(self) -> tuple[str, str] | None:
        """``(reason, by)`` of the stop asked for, or ``None``."""
        return self._stop

    def record_stop(self, *, epoch: int, step: int, reason: str | None = None, by: str = "") -> int:
        """Emit the ``stop_requested`` event: of the pending request, or of ``reason`` (an update
        boundary). Returns its seq."""
        if reason is None:
            assert self._stop is not None, "record_stop without a stop request"
            reason, by = self._stop
        return self.recorder.emit(StopRequested(epoch=epoch, step=step, reason=reason, by=by))
