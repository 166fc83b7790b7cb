"""Silent rank divergence, caught: the ranks compare a digest of their parameters.

Data parallelism keeps the replicas identical only if every rank applies the same update;
a rank-local change (a hook touching the weights on one rank, a non-deterministic kernel, a
bit flip) makes them drift apart silently, and the writer's checkpoint then stands for one
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
from typing import Any

import torch
from torch import nn

from events.schema import ParamsDigested
from nnx_es.errors import DivergenceError

__all__ = ["ParamDigest", "params_digest"]


def params_digest(net: nn.Module) -> str:
    """BLAKE2b-128 hex of ``net``'s state (every parameter and buffer: name, dtype, shape, bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in net.state_dict().items():
        t = t.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ParamDigest:
    """The digest checks of one fit (built by the trainer under DDP; ``every``: updates, or None
    for each epoch's end)."""

    def __init__(self, net: nn.Module, world: Any, every: int | None) -> None:
        self.net, self.world, self.every = net, world, every
        self.since = 0  # the step of the last agreeing digest

    def after_update(self, recorder: Any, *, epoch: int, step: int) -> None:
        """After a committed update: compare when ``step`` is a multiple of ``every``."""
        if self.every is not None and step % self.every == 0:
            self.check(recorder, epoch=epoch, step=step)

    def at_epoch_end(self, recorder: Any, *, epoch: int, step: int) -> None:
        """After the epoch's last update (before validation): compare when ``every`` is None."""
        if self.every is None:
            self.check(recorder, epoch=epoch, step=step)

    def check(self, recorder: Any, *, epoch: int, step: int) -> None:
        """Gather every rank's digest, record them, and stop on a difference.

        Raises:
            DivergenceError: on every rank alike, naming the differing ranks and the step range.
        """
        mine = torch.frombuffer(bytearray.fromhex(params_digest(self.net)), dtype=torch.uint8)
        digests = [bytes(t.tolist()).hex() for t in self.world.gather_tensor(mine)]  # one all-gather of 16 bytes
        agreed = len(set(digests)) == 1
        recorder.emit(ParamsDigested(epoch=epoch, step=step, digests=digests, diverged=not agreed,
                                    since_step=self.since))
        if agreed:
            self.since = step
            return
        ref = digests[self.world.writer_rank]
        apart = [r for r, d in enumerate(digests) if d != ref]
        raise DivergenceError(
            f"the ranks' parameters diverged: rank(s) {apart} hold parameters that differ from the writer rank "
            f"{self.world.writer_rank}'s after {step} committed updates (epoch {epoch}); they first differed after "
            f"step {self.since} (the last digest on which every rank agreed) and at or before step {step}: something "
            "changed the weights on one rank only (a hook or callback touching them, a rank-local RNG, a "
            "non-deterministic kernel); the checkpoints written before it are every rank's")
