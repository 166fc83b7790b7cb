"""Data parallelism as a strategy the update engine is given (:class:`DataParallel`): microbatches
through DDP, and the window's agreement.

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

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from nnx_es.grads import WindowGradients
    from nnx_es.runtime.run_state import World
    from nnx_es.runtime.window import AccumulationWindow

__all__ = ["HOST_PARTS_ON_CPU", "DataParallel"]

#: stage the window's agreement from the host when its losses are on the CPU (floats, parts cut in
#: Python); False: every device's way, on the device (tests run both)
HOST_PARTS_ON_CPU = True

_FLOAT32_SUMS = (torch.float32, torch.bfloat16, torch.float16)
_TINY32 = 2.0**-149  # float32's smallest subnormal: a W that is a multiple of it is a float32 sum too


class DataParallel:
    """One ``fit``'s data parallelism: ``module`` (a ``DistributedDataParallel`` wrapping the
    engine's net) and ``world`` (the process group). Built by :func:`nnx_es.distributed.wrap.data_parallel`'s
    caller for the fit; handed to the engine (:meth:`nnx_es.runtime.engine.UpdateEngine.under`)."""

    def __init__(self, module: nn.Module, world: World) -> None:
        from nnx_es.distributed.fused import FusedAgreement

        self.module = module
        self.world = world
        #: [numerator, W] ride in the last gradient bucket's all-reduce: one collective per window
        self.fused = FusedAgreement(module)
        self.syncing = False  # the current microbatch's backward synchronizes the gradients
        self.unsynced = False  # the window's last backward ran under no_sync (a trailing short window)

    def around(self, window: AccumulationWindow) -> Any:
        """The context a microbatch of ``window`` runs in: ``no_sync`` unless it fills the window."""
        if window.microbatches + 1 < window.size:
            self.syncing = False
            self.unsynced = True
            return self.module.no_sync()  # type: ignore[operator]
        self.unsynced = False
        self.syncing = True
        return contextlib.nullcontext()

    def stage(self, window: AccumulationWindow, loss_t: Tensor, den: float, ign: Tensor | None) -> float | None:
        """Add this microbatch to the window's ``[numerator, W]``; the window's last (synchronizing)
        microbatch stages them for DDP's last gradient bucket (:mod:`nnx_es.distributed.fused`).
        ``ign``: its rows of ignored targets (``W`` leaves them out), or None.

        On the CPU (:data:`HOST_PARTS_ON_CPU`) the numerator is a float formed by the same float64
        additions, ``W`` is read once, and both are staged from the host: bitwise the same sums.
        Returns the microbatch's loss read then (a float: the window's read takes it, not reading
        ``loss_t`` again), or None when it stays on the device."""
        fused = self.fused
        host = HOST_PARTS_ON_CPU and loss_t.device.type == "cpu"
        value = None
        if host:
            value = loss_t.item()
            num = value if window.num_t is None else window.num_t + value  # type: ignore[operator]
            window.num_t = num
        else:
            num_t = loss_t.double() if window.num_t is None else window.num_t + loss_t.double()
            window.num_t = num_t
        if loss_t.dtype not in _FLOAT32_SUMS:
            window.float32_sums = False
        if ign is not None:
            window.ign_t = ign if window.ign_t is None else window.ign_t + ign
            if ign.is_floating_point():  # rows' worth of ignored positions: W need not sit on the float32 grid
                window.float32_sums = False
        if self.syncing and host:
            w = window.den + den
            on_grid = window.float32_sums and math.isfinite(w) and math.fmod(w, _TINY32) == 0.0
            if window.ign_t is not None:  # W as the device path forms it: float64 less the (exact) count
                w -= window.ign_t.item()  # type: ignore[union-attr]
            fused.stage_host((num, w), float32_sums=on_grid)
        elif self.syncing:  # declared float32 sums from the host alone: the dtypes, W's value (no read)
            w = window.den + den
            w_t = num_t.new_tensor(w)
            if window.ign_t is not None:  # less the window's ignored targets (integers: W stays on the grid)
                w_t = w_t - window.ign_t
            fused.stage(torch.stack((num_t, w_t)), float32_sums=window.float32_sums
                        and math.isfinite(w) and math.fmod(w, _TINY32) == 0.0)  # fused.float32_sum
        return value

    def agree(self, window: AccumulationWindow, grads: WindowGradients) -> None:
        """The window's one agreement: read this rank's losses, then the window's ``[sum of numerators,
        sum of denominators]`` summed over the ranks into ``window.global_den`` (the global ``W``),
        ``window.num`` and ``window.nonfinite`` (the held microbatches are read: ``window.reads``).

        The sums travel with the gradients: staged before the window's synchronizing backward, they
        ride in the last bucket's all-reduce (:class:`~nnx_es.distributed.fused.FusedAgreement`), so a
        window costs one collective. A window whose last backward ran under ``no_sync`` (the
        epoch's trailing short window) has its gradients (``grads``) summed here, then ONE
        all-reduce of ``[numerators, denominators, non-finite flag]``. After it every rank holds the
        same numerator (the receipt's loss is global), ``W`` and non-finite mark (a sum is finite only
        when every rank's numerator is), so every rank skips or steps alike.
        """
        wg = grads
        window.read()
        world = self.world
        fused = self.fused
        carried = fused.result() if not self.unsynced else None
        if carried is not None:  # summed by the gradients' own all-reduce (nnx_es.distributed.fused)
            num, W = carried
            window.num = num
            window.nonfinite = not math.isfinite(num)  # a sum is finite only if every term was
            window.global_den = W
            window.collective_bytes += wg.nbytes + fused.last_bytes
            return
        if self.unsynced:
            self.unsynced = False
            grads = [p.grad for p in wg.params if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                world.agree(flat)
                flat /= world.size  # as DDP's own all-reduce: the ranks' mean
                torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]),
                                                                          grads)])
        agreed = world.agree(torch.tensor([window.num, window.den, 1.0 if window.nonfinite else 0.0],
                                          dtype=torch.float64)).tolist()
        window.num = agreed[0]
        window.nonfinite = agreed[2] > 0 or not math.isfinite(agreed[0])
        window.global_den = agreed[1]
        # the receipt's collective bytes: the gradients' all-reduce (DDP's, or the one above) and this agreement
        window.collective_bytes += wg.nbytes + 24
