"""The window's agreement carried by DDP's own gradient all-reduce: one collective per update.

Today a data-parallel window ends with two collectives: DDP's gradient all-reduce inside the
last microbatch's backward, then the engine's all-reduce of ``[numerator, denominator,
non-finite flag]``. Each is a round trip in which every rank waits for the slowest and gloo's
threads must be scheduled again; on a small model (the digits MLP: one bucket) the second one
costs about as much as the first (``bench/ddp.py``: the hand-written loop with a second
all-reduce per step against the same loop with :class:`FusedAgreement`).

:class:`FusedAgreement` is a DDP communication hook (``DistributedDataParallel.register_comm_hook``,
torch's documented extension point) that appends the staged values to the last bucket the
reducer all-reduces in a backward and splits them off again:

* the last bucket and the values are summed in float64 -- the values exactly as a float64
  all-reduce of their own gives them; the bucket's gradients are the float64 sum of the ranks'
  float32 gradients, divided by the world size and rounded once to float32 (with 2 ranks that
  is exactly what a float32 sum gives: IEEE addition is correctly rounded);
* every other bucket, and a backward with nothing staged, is reduced as torch's default hook
  does (``allreduce_hook``: divide by the world size, sum).

The values must be known before the backward that synchronizes (they are: the window's losses
and denominators are formed by its forwards); :meth:`FusedAgreement.result` reads the sums
after that backward returned (DDP waits for every bucket's future before ``backward`` returns).
A backward under ``no_sync`` runs no hook: the staged values wait for the next synchronizing one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nnx_es.errors import ConfigError

__all__ = ["FusedAgreement"]


class FusedAgreement:
    """Sum a small vector over the ranks inside DDP's gradient all-reduce (see the module docstring).

    Args:
        ddp: a ``torch.nn.parallel.DistributedDataParallel``; the hook is registered on it (once:
            DDP takes one comm hook).
        group: the process group (default: DDP's own, the default group).

    Raises:
        ConfigError: ``ddp`` already has a comm hook (torch raises then; the message says so).
    """

    def __init__(self, ddp: Any, group: Any = None) -> None:
        self.group = group
        self._staged: Tensor | None = None
        self._result: Tensor | None = None
        try:
            ddp.register_comm_hook(self, FusedAgreement._hook)
        except RuntimeError as exc:
            raise ConfigError(f"FusedAgreement: this DDP module already has a communication hook ({exc})") from None

    def stage(self, values: Tensor) -> None:
        """Values (1-D, any float dtype, on the buckets' device) to sum with the next synchronizing backward."""
        if values.dim() != 1:
            raise ConfigError(f"FusedAgreement.stage takes a 1-D tensor, got shape {tuple(values.shape)}")
        self._staged = values.detach().to(torch.float64)
        self._result = None

    def result(self) -> Tensor | None:
        """The staged values summed over the ranks (float64, 1-D), once the backward carrying them returned;
        ``None`` if no synchronizing backward carried them yet. Each result is handed out once."""
        out, self._result = self._result, None
        return out

    @staticmethod
    def _hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none (a GradBucket)
        buf = bucket.buffer()
        size = dist.get_world_size(state.group)
        staged = state._staged
        if staged is None or not bucket.is_last():
            buf.div_(size)
            work = dist.all_reduce(buf, group=state.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        state._staged = None
        n = buf.numel()
        joined = torch.cat([buf.to(torch.float64), staged.to(buf.device)])
        work = dist.all_reduce(joined, group=state.group, async_op=True)

        def split(fut: torch.futures.Future) -> Tensor:
            out = fut.value()[0]
            state._result = out[n:].clone()
            buf.copy_(out[:n].div_(size))
            return buf

        return work.get_future().then(split)
