"""The update engine's data-parallel window (:class:`DataParallelWindow`, a part of
:class:`nnx_es.engine.UpdateEngine`): microbatches through DDP, the window's agreement.

Under DDP (spec 000 "Single-node data parallelism", "One update") every microbatch but a
window's last runs under ``no_sync``; the last one's backward all-reduces the gradients and, in
its last bucket, the window's ``[numerator, W]`` staged on the device
(:class:`~nnx_es.distributed.fused.FusedAgreement`): one collective per window. The epoch's
trailing short window (its last backward under ``no_sync``) sums its gradients and agrees
``[numerators, denominators, non-finite flag]`` in one all-reduce at its end.

On the CPU (:data:`HOST_PARTS_ON_CPU`) the window's ``[numerator, W]`` are kept as floats (a CPU
tensor is read without waiting for any device) and staged from the host
(:meth:`~nnx_es.distributed.fused.FusedAgreement.stage_host`): about a dozen small torch ops less
per window, the same sums bitwise. On an accelerator they stay on the device until the window's
one read.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from nnx_es.context import TrainContext

__all__ = ["HOST_PARTS_ON_CPU", "DataParallelWindow"]

#: stage the window's agreement from the host when its losses are on the CPU (floats, parts cut in
#: Python); False: every device's way, on the device (tests run both)
HOST_PARTS_ON_CPU = True

_FLOAT32_SUMS = (torch.float32, torch.bfloat16, torch.float16)
_TINY32 = 2.0**-149  # float32's smallest subnormal: a W that is a multiple of it is a float32 sum too


class DataParallelWindow:
    """The engine's methods of the data-parallel path; its state lives on the engine
    (``_ddp``, ``_fused``, ``_syncing``, ``_unsynced``, ``_w_num_t``, ``_w_ign_t``, ``_w_float32_sums``;
    the window's ``_w_num_t`` and ``_w_ign_t`` are Python floats when staged from the host)."""

    _ddp: Any
    _fused: Any

    def use_ddp(self, ddp: Any) -> None:
        """Run microbatches through ``ddp`` (a ``DistributedDataParallel`` wrapping this engine's net),
        or, with ``None``, through the net itself again (once per ``fit``; see :mod:`nnx_es.distributed`).

        Under DDP every microbatch but a window's last runs under ``ddp.no_sync()`` (gradients
        accumulate locally); the last one's backward averages them over the ranks. Its denominator
        ``W`` and finiteness are agreed at the window's end (:meth:`finalize_step`).
        """
        self._ddp = ddp
        self._forward_net = ddp if ddp is not None else self.net
        self._fused = None
        if ddp is not None:
            from nnx_es.distributed.fused import FusedAgreement

            # [numerator, W] ride in the last gradient bucket's all-reduce: one collective per window
            self._fused = FusedAgreement(ddp)

    def microbatch(self, ctx: TrainContext, batch: Any) -> None:
        """Forward and backward one microbatch; emit ``microbatch_done``.

        Under DDP (:meth:`use_ddp`) a microbatch that does not fill the window runs under
        ``no_sync`` (no collective); the window's last one synchronizes the gradients."""
        ddp = self._ddp
        if ddp is not None:
            if self.w_microbatches + 1 < self.accumulation:
                self._syncing = False
                with ddp.no_sync():
                    self._microbatch(ctx, batch)
                self._unsynced = True
                return
            self._unsynced = False
            self._syncing = True
        self._microbatch(ctx, batch)

    def _stage_agreement(self, loss_t: Tensor, den: float, ign: Tensor | None) -> float | None:
        """Add this microbatch to the window's ``[numerator, W]`` on the device; the window's last
        (synchronizing) microbatch stages them for DDP's last gradient bucket (:mod:`nnx_es.distributed.fused`).
        ``ign``: its rows of ignored targets (``W`` leaves them out), or None.

        On the CPU (:data:`HOST_PARTS_ON_CPU`) the numerator is a float formed by the same float64
        additions, ``W`` is read once, and both are staged from the host: bitwise the same sums.
        Returns the microbatch's loss read then (a float: the window's read takes it, not reading
        ``loss_t`` again), or None when it stays on the device."""
        fused = self._fused
        host = HOST_PARTS_ON_CPU and loss_t.device.type == "cpu"
        value = None
        if host:
            value = loss_t.item()
            num = value if self._w_num_t is None else self._w_num_t + value  # type: ignore[operator]
            self._w_num_t = num  # type: ignore[assignment]
        else:
            num_t = loss_t.double() if self._w_num_t is None else self._w_num_t + loss_t.double()
            self._w_num_t = num_t
        if loss_t.dtype not in _FLOAT32_SUMS:
            self._w_float32_sums = False
        if ign is not None:
            self._w_ign_t = ign if self._w_ign_t is None else self._w_ign_t + ign
            if ign.is_floating_point():  # rows' worth of ignored positions: W need not sit on the float32 grid
                self._w_float32_sums = False
        if self._syncing and host:
            w = self.w_den + den
            on_grid = self._w_float32_sums and math.isfinite(w) and math.fmod(w, _TINY32) == 0.0
            if self._w_ign_t is not None:  # W as the device path forms it: float64 less the (exact) count
                w -= self._w_ign_t.item()
            fused.stage_host((num, w), float32_sums=on_grid)
        elif self._syncing:  # declared float32 sums from the host alone: the dtypes, W's value (no read)
            w = self.w_den + den
            w_t = num_t.new_tensor(w)
            if self._w_ign_t is not None:  # less the window's ignored targets (integers: W stays on the grid)
                w_t = w_t - self._w_ign_t
            fused.stage(torch.stack((num_t, w_t)), float32_sums=self._w_float32_sums
                        and math.isfinite(w) and math.fmod(w, _TINY32) == 0.0)  # fused.float32_sum
        return value

    def _agree_window(self) -> float:
        """The window's one agreement (data parallelism): read this rank's losses, then the window's
        ``[sum of numerators, sum of denominators]`` summed over the ranks; return the global ``W``.

        The sums travel with the gradients: staged before the window's synchronizing backward, they
        ride in the last bucket's all-reduce (:class:`~nnx_es.distributed.fused.FusedAgreement`), so a
        window costs one collective. A window whose last backward ran under ``no_sync`` (the
        epoch's trailing short window) has its gradients summed here, then ONE all-reduce of
        ``[numerators, denominators, non-finite flag]``. After it every rank holds the same
        numerator (the receipt's loss is global), ``W`` and non-finite mark (a sum is finite only
        when every rank's numerator is), so every rank skips or steps alike.
        """
        self._settle()
        world = self.state.world
        fused = self._fused
        carried = fused.result() if fused is not None and not self._unsynced else None
        if carried is not None:  # summed by the gradients' own all-reduce (nnx_es.distributed.fused)
            num, W = carried
            self.w_num = num
            self.w_nonfinite = not math.isfinite(num)  # a sum is finite only if every term was
            self.w_global_den = W
            self.w_collective_bytes += self._grad_bytes + fused.last_bytes
            return W  # type: ignore[no-any-return]
        if self._unsynced:
            self._unsynced = False
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                world.agree(flat)
                flat /= world.size  # as DDP's own all-reduce: the ranks' mean
                torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]),
                                                                          grads)])
        agreed = world.agree(torch.tensor([self.w_num, self.w_den, 1.0 if self.w_nonfinite else 0.0],
                                          dtype=torch.float64)).tolist()
        self.w_num = agreed[0]
        self.w_nonfinite = agreed[2] > 0 or not math.isfinite(agreed[0])
        self.w_global_den = agreed[1]
        # the receipt's collective bytes: the gradients' all-reduce (DDP's, or the one above) and this agreement
        self.w_collective_bytes += self._grad_bytes + 24
        return agreed[1]
