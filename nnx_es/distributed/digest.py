"""Silent rank divergence, caught: the ranks compare a digest of their parameters.

Data parallelism keeps the replicas identical only if every rank applies the same update;
a setting that differs between ranks (a learning rate, scheduler or gradient clipping computed
per rank) or a rank-local change (a hook touching the weights on one rank, a non-deterministic
kernel, a bit flip) makes them drift apart silently, and the writer's checkpoint then stands for one
rank only. No peer trainer checks this. Every ``DDP(digest_every=K)`` committed updates
(default ``None``: at each epoch's last update) every rank hashes its parameters and buffers
-- BLAKE2b-128 over their exact bytes, in ``state_dict`` order -- and one all-gather gives
every rank all the digests. They are recorded as ``params_digested``; when they differ, the
run stops on every rank (:class:`~nnx_es.errors.DivergenceError`) naming the ranks whose
digest differs from the writer's and the steps between which they first differed.
``tools/replay`` checks every recorded digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from events.schema import ParamsDigested
from nnx_es.errors import DivergenceError

__all__ = ["ParamDigest", "params_digest", "ranks_apart"]


def params_digest(net: nn.Module) -> str:
    """BLAKE2b-128 hex of ``net``'s state (every parameter and buffer: name, dtype, shape, bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in net.state_dict().items():
        t = t.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def ranks_apart(digests: Sequence[Any], writer_rank: int) -> list[int]:
    """The ranks whose digest (index = rank) differs from ``writer_rank``'s, in rank order."""
    return [r for r, d in enumerate(digests) if d != digests[writer_rank]]


class ParamDigest:
    """The digest checks of one fit (built by the trainer under DDP; ``every``: updates, or None
    for each epoch's end)."""

    def __init__(self, net: nn.Module, world: Any, every: int | None) -> None:
        self.net, self.world, self.every = net, world, every
        self.since = 0  # the step of the last agreeing digest
        self._deferred: tuple[torch.Tensor, int, int] = (torch.empty(0, dtype=torch.uint8), 0, 0)

    def after_update(self, recorder: Any, *, epoch: int, step: int) -> None:
        """After a committed update: compare when ``step`` is a multiple of ``every``."""
        if self.every is not None and step % self.every == 0:
            self.check(recorder, epoch=epoch, step=step)

    def at_epoch_end(self, recorder: Any, *, epoch: int, step: int, defer: bool = False) -> list[float] | None:
        """After the epoch's last update (before validation): compare when ``every`` is None.

        ``defer``: nothing is recorded between here and the epoch's sums agreement (no validation
        pass this epoch): return the values to add to that all-reduce (:meth:`settle` decides from
        their sums) instead of a collective of the digest's own; ``None`` when nothing is deferred."""
        if self.every is not None:
            return None
        if not defer:
            self.check(recorder, epoch=epoch, step=step)
            return None
        mine = self._mine()
        self._deferred = (mine, epoch, step)
        # byte b of every rank's digest: sum and sum of squares, exact in float64; the ranks agree
        # on every byte iff world * (sum of squares) == sum**2 (Cauchy-Schwarz, equality iff all equal)
        values = mine.tolist()
        return [float(b) for b in values] + [float(b * b) for b in values]

    def settle(self, recorder: Any, sums: list[float]) -> None:
        """Decide the deferred comparison from the summed values :meth:`at_epoch_end` returned: equal
        digests are recorded as they are (no collective); on a difference the digests are gathered
        (to record and name them) and the run stops as :meth:`check` does.

        Raises:
            DivergenceError: on every rank alike (the sums are the same on every rank).
        """
        mine, epoch, step = self._deferred
        half = len(sums) // 2
        n = self.world.size
        if all(n * q == s * s for s, q in zip(sums[:half], sums[half:])):
            self._decide(recorder, [bytes(mine.tolist()).hex()] * n, epoch=epoch, step=step)
        else:
            self._decide(recorder, [bytes(t.tolist()).hex() for t in self.world.gather_tensor(mine)], epoch=epoch,
                         step=step)

    def due_at_end(self, step: int) -> bool:
        """Whether the end of training (no failure) after ``step`` committed updates compares once more: the
        last agreeing digest is not of that step (``every`` beyond the run's updates, the updates after its
        last multiple, a stop at an update boundary). Then :meth:`check` with ``final=True``, so every
        completed or stopped run ends with its replicas compared."""
        return step != self.since

    def _mine(self) -> torch.Tensor:
        return torch.frombuffer(bytearray.fromhex(params_digest(self.net)), dtype=torch.uint8)

    def check(self, recorder: Any, *, epoch: int, step: int, final: bool = False) -> None:
        """Gather every rank's digest, record them, and stop on a difference.

        Raises:
            DivergenceError: on every rank alike, naming the differing ranks, the step range and
                the likely causes (a setting that differs between ranks first).
        """
        digests = [bytes(t.tolist()).hex() for t in self.world.gather_tensor(self._mine())]  # one all-gather of 16 bytes
        self._decide(recorder, digests, epoch=epoch, step=step, final=final)

    def _decide(self, recorder: Any, digests: list[str], *, epoch: int, step: int, final: bool = False) -> None:
        agreed = len(set(digests)) == 1
        recorder.emit(ParamsDigested(epoch=epoch, step=step, digests=digests, diverged=not agreed,
                                    since_step=self.since, final=final))
        if agreed:
            self.since = step
            return
        apart = ranks_apart(digests, self.world.writer_rank)
        raise DivergenceError(
            f"the ranks' parameters diverged: rank(s) {apart} hold parameters that differ from the writer rank "
            f"{self.world.writer_rank}'s after {step} committed updates (epoch {epoch}); they first differed after "
            f"step {self.since} (the last digest on which every rank agreed) and at or before step {step}: the ranks "
            "applied different updates. Most often a setting differs between ranks (a learning rate, a scheduler, "
            "gradient clipping, the optimizer's arguments, computed per rank, e.g. from RANK): build every rank's "
            "trainer with the same settings; otherwise something changed the weights on one rank only (a hook or "
            "callback touching them, a rank-local RNG, a non-deterministic kernel); the checkpoints written before "
            "it are every rank's")
