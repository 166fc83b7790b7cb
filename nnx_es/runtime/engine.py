"""The update engine: the computation of microbatches and of the update their window commits.

It computes and returns values; it records no event, dispatches no callback and keeps no run
state (the step recorder, :mod:`nnx_es.runtime.steps`, does that with what it returns). It
imports neither the context, the callbacks nor the recorder: the hooks' view (``ctx``) is handed
to it only to pass on to the stage and update hooks it runs, and to show them the microbatch
(``predictions``, ``targets``, ``loss``) before they run.

Per microbatch (:meth:`UpdateEngine.microbatch`)::

    outputs, targets, weights = train_step_fn(net, batch)        # under autocast when enabled
    parts = objective(outputs, targets, weights)                 # numerators + denominator
    backward(parts.total)   (scaled by the GradScaler if any; skipped when den == 0, and, with a
                             GradScaler's backward, when the loss is not finite)
    window.hold(loss)       its loss stays on the device until the window's end
    -> (outputs, targets, weights, parts, loss)                  a MicrobatchResult

At the window's end (:meth:`UpdateEngine.update`), in this order (spec 000 "Lifecycle order"
and §3 "One update")::

    W = sum of the window's denominators (over the ranks: the data-parallel strategy's agreement)
    W == 0                      -> skipped: masked              no step
    a loss was not finite       -> skipped: nonfinite
    unscale (GradScaler) ; coalesce sparse grads ; grad /= W
    a gradient not finite       -> skipped: nonfinite   (the scaler lowers its scale)
                                   (checked from the total L2 norm when it is computed -- with
                                   clipping or ``track_grad_norm`` -- else by one fused check,
                                   which also does the division when its divisor is a power of
                                   two: bitwise the same, one op less; nnx_es.grads)
    an update hook vetoes       -> skipped: vetoed
    clip (max_norm) -> optimizer.step() for every optimizer -> update hooks' after_step
    zero grads
    -> an UpdateResult (committed or the skip's reason, the receipt's accounting); the window's
       reads wait in ``window.reads`` for the recorder

The window's losses are read once, at its end, with the gradients' finiteness flag or norm
(:class:`~nnx_es.runtime.window.AccumulationWindow`); with a GradScaler, or a stage hook before
the optimizer step (which may change the gradients), the losses are read first and the
gradients' check after (two reads); a GradScaler's backward reads each microbatch's loss.

Dividing the accumulated gradient by W makes the update the gradient of the mean loss over
the whole window, with unequal microbatch sizes and masks. Sparse gradients take the same
steps with the same results as the dense gradient they stand for (:mod:`nnx_es.grads`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from nnx_es.batches import split_batch
from nnx_es.errors import ConfigError
from nnx_es.grads import WindowGradients, exact_reciprocal
from nnx_es.objective import LossParts, Objective
from nnx_es.runtime.window import AccumulationWindow
from nnx_es.stages import StageDispatcher, TrainingStage

if TYPE_CHECKING:
    from nnx_es.runtime.parallel import DataParallel

__all__ = ["MicrobatchResult", "UpdateEngine", "UpdateResult", "UpdateSettings", "default_forward"]

StepFn = Callable[[nn.Module, Any], tuple[Tensor, Tensor, "Tensor | None"]]

#: one microbatch's values: (outputs (B, ...), targets, weights (B,) or None, its LossParts, its loss
#: numerator detached (0-dim, on the device: read with the window))
MicrobatchResult = tuple[Any, Any, "Tensor | None", LossParts, Tensor]

PRECISIONS = ("fp32", "bf16", "fp16")

_LR = operator.itemgetter("lr")
#: a window's gradients, those that are set: ``filter(_IS_SET, map(_GRAD, params))`` (no Python call per parameter)
_GRAD, _IS_SET = operator.attrgetter("grad"), partial(operator.is_not, None)


def default_forward(net: nn.Module, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """The default ``train_step_fn`` and ``eval_step_fn``: ``outputs = net(inputs)``.

    Returns ``(outputs (B, ...), targets (B, ...), weights (B,) or None)``.
    """
    inputs, targets, weights = split_batch(batch)
    return net(inputs), targets, weights


@dataclass(frozen=True)
class UpdateSettings:
    """How a window becomes an update: ``accumulation`` microbatches per window (>= 1),
    ``clip_grad_norm`` (max total L2 norm, > 0, or None), ``precision`` (``"fp32"``, ``"bf16"``:
    autocast, ``"fp16"``: autocast + GradScaler starting at ``init_scale``), ``track_grad_norm``
    (record every window's norm before clipping; clipping always computes it).

    One place decides them: the Trainer's shortcut arguments or the built-in update hooks
    (:func:`nnx_es.update_hooks.settings_of`).

    Raises:
        ConfigError: ``accumulation`` < 1, ``clip_grad_norm`` <= 0 or another precision.
    """

    accumulation: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    init_scale: float = 2.0**16
    track_grad_norm: bool = False

    def __post_init__(self) -> None:
        if self.accumulation < 1:
            raise ConfigError(f"accumulation must be >= 1 microbatch, got {self.accumulation!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")


class UpdateResult(msgspec.Struct):
    """What one window's end did: ``reason`` None (committed) or why it was skipped
    (``"masked"``, ``"nonfinite"``, ``"vetoed"``) with ``detail``; ``optimizers`` stepped (or
    skipped) by name; ``microbatches``; ``loss`` the window's mean loss; ``grad_norm`` (None when not
    computed), ``clipped``; ``lrs`` each optimizer's learning rates at the step; ``counts`` the step
    receipt's accounting (local / global examples, data-parallel size, accumulation steps,
    collective bytes). A struct: built without a Python call, once per update."""

    reason: str | None
    detail: str
    optimizers: list[str]
    microbatches: int
    loss: float
    grad_norm: float | None
    clipped: bool
    lrs: dict[str, list[float]]
    counts: dict[str, Any]

    @property
    def committed(self) -> bool:
        return self.reason is None


class UpdateEngine:
    """Computes microbatches and commits one optimizer update per window (see the module docstring).

    Args:
        net: the model whose parameters the window's gradients belong to.
        optimizers: ``{name: optimizer}``, stepped together once per committed window.
        objective: the loss.
        settings: accumulation, clipping, precision, norm tracking (:class:`UpdateSettings`).
        train_step_fn: ``fn(net, batch) -> (outputs, targets, weights | None)`` (default: :func:`default_forward`).
        stages: the stage hooks (those of the microbatch and the update run here).
        orchestrator: the update hooks, folded (:class:`nnx_es.update_hooks.UpdateOrchestrator`):
            an owned backward or step, vetoes, after-step hooks; None: none.
        parallel: the data-parallel strategy (:class:`nnx_es.runtime.parallel.DataParallel`), or
            None for one process; see :meth:`under`.
        scaler / grads: a GradScaler and window gradients to share (an engine made by :meth:`under`).
    """

    def __init__(self, net: nn.Module, optimizers: dict[str, Optimizer], objective: Objective,
                 settings: UpdateSettings = UpdateSettings(), *, train_step_fn: StepFn | None = None,
                 stages: StageDispatcher | None = None, orchestrator: Any = None,
                 parallel: DataParallel | None = None, scaler: Any = None,
                 grads: WindowGradients | None = None) -> None:
        self.net = net
        self.optimizers = optimizers
        self._names = list(optimizers)
        self._optimizers = list(optimizers.values())
        self._named = list(optimizers.items())
        self.objective = objective
        self._several = len(objective.terms) > 1  # several loss terms: their numerators are read too
        self.settings = settings
        self.accumulation = settings.accumulation
        self.clip_grad_norm = settings.clip_grad_norm
        self.track_grad_norm = settings.track_grad_norm
        self.precision = settings.precision
        self.train_step_fn = train_step_fn or default_forward
        self.stages = stages if stages is not None else StageDispatcher([])
        self._stages = self.stages if self.stages.by_stage else None  # None: no stage hook, nothing to dispatch
        #: a stage hook before the step may change the gradients: the losses are read first (two reads)
        self._read_early = self.stages.has(TrainingStage.BEFORE_OPTIMIZER_STEP)
        self.orchestrator = orchestrator
        self.parallel = parallel
        #: the net every microbatch runs through (a DistributedDataParallel wrapper under data parallelism)
        self.forward_net: nn.Module = parallel.module if parallel is not None else net
        device_type = next((p.device.type for p in net.parameters()), "cpu")
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        #: a new autocast region per microbatch; ``None``: fp32 enters none
        self._autocast: Callable[[], Any] | None = (
            (lambda: torch.autocast(device_type, dtype=dtype)) if self.precision != "fp32" else None)
        if scaler is None and self.precision == "fp16":
            scaler = torch.amp.GradScaler(device_type, init_scale=settings.init_scale)
        self.scaler = scaler
        #: the trainable parameters' gradients at a window's end (layout, finiteness: nnx_es.grads)
        self.grads = grads if grads is not None else WindowGradients([p for p in net.parameters() if p.requires_grad])
        self.window = AccumulationWindow(self.accumulation)
        if parallel is None:  # one process: a microbatch is the computation itself, no no_sync context
            self.microbatch = self._microbatch  # type: ignore[method-assign]
        self._inverse_key: tuple[float, torch.dtype, torch.device] | None = None
        self._inverse_t = torch.ones(())

    def under(self, parallel: DataParallel | None, *, accumulation: int | None = None) -> UpdateEngine:
        """This engine's computation for one ``fit``: through ``parallel`` (data parallelism; None: one
        process) and, when given, with a window of ``accumulation`` microbatches (an elastic train
        loader's deal: :func:`nnx_es.distributed.resize.global_batch_accumulation`). A new engine over
        the same net, optimizers, hooks, GradScaler and gradients."""
        settings = self.settings if accumulation is None else replace(self.settings, accumulation=accumulation)
        return UpdateEngine(self.net, self.optimizers, self.objective, settings, train_step_fn=self.train_step_fn,
                            stages=self.stages, orchestrator=self.orchestrator, parallel=parallel, scaler=self.scaler,
                            grads=self.grads)

    @property
    def window_full(self) -> bool:
        return self.window.microbatches >= self.accumulation

    # --- one microbatch -------------------------------------------------------------------

    def microbatch(self, batch: Any, ctx: Any) -> MicrobatchResult:
        """Forward and backward one microbatch into the window; return its values.

        ``ctx``: the hooks' view (shown the outputs, targets and loss; handed to the hooks).
        Under data parallelism a microbatch that does not fill the window runs under ``no_sync``
        (no collective); the window's last one synchronizes the gradients.
        """
        parallel = self.parallel
        if parallel is None:
            return self._microbatch(batch, ctx)
        with parallel.around(self.window):
            return self._microbatch(batch, ctx)

    def _microbatch(self, batch: Any, ctx: Any) -> MicrobatchResult:
        stages = self._stages
        autocast = self._autocast
        if autocast is None:
            outputs, targets, weights, parts = self._forward(batch, ctx, stages)
        else:
            with autocast():
                outputs, targets, weights, parts = self._forward(batch, ctx, stages)
        total = parts.total
        den = parts.den
        ign = parts.ignored  # rows of ignored targets (an ignore_index): den - ign is exact, read with the window
        loss_t = total.detach()  # stays on the device: read with the window
        ctx.loss_pending = (loss_t, den, ign)  # shown to the hooks, read only when one asks (ctx.loss)
        window = self.window
        parallel = self.parallel
        known = None  # the loss's value, when the host read it already (the DDP agreement staged from the CPU)
        if parallel is not None:  # DDP: the window's [numerator, W] go with the synchronizing backward
            known = parallel.stage(window, loss_t, den, ign)
        if stages:
            stages(TrainingStage.AFTER_LOSS, ctx)
            stages(TrainingStage.BEFORE_BACKWARD, ctx)
        if den > 0 or parallel is not None:  # under DDP every rank takes part in the gradients' all-reduce
            owner = self.orchestrator.backward_owner if self.orchestrator is not None else None
            if owner is not None:
                # an owned backward (a GradScaler's) is never handed a non-finite loss: read it now
                if math.isfinite(loss_t.item()):
                    owner.backward(ctx, total)
            elif self.accumulation == 1 and parallel is None:
                # a one-microbatch window: its W is this den, so the mean is taken here, not on the
                # grads: total x (1/den), whose backward hands the sum's exactly 1/den (no division op).
                # A non-finite loss is backpropagated too (no host read to tell): the window's end reads
                # it and skips the update, and its gradients are zeroed unused.
                (total * self._inverse(den, total)).backward()
                window.divided = True
                window.scale = den
            else:
                total.backward()
        if stages:
            stages(TrainingStage.AFTER_BACKWARD, ctx)
        window.hold(loss_t, den, parts.terms if self._several else None, ign, known)
        return outputs, targets, weights, parts, loss_t

    def _forward(self, batch: Any, ctx: Any,
                 stages: StageDispatcher | None) -> tuple[Tensor, Tensor, Tensor | None, LossParts]:
        """``train_step_fn`` and the objective (inside the caller's autocast region, if any)."""
        if stages:
            stages(TrainingStage.BEFORE_FORWARD, ctx)
        outputs, targets, weights = self.train_step_fn(self.forward_net, batch)
        ctx.predictions, ctx.targets = outputs, targets
        if stages:
            stages(TrainingStage.AFTER_FORWARD, ctx)
            stages(TrainingStage.BEFORE_LOSS, ctx)
        return outputs, targets, weights, self.objective(outputs, targets, weights)

    def _inverse(self, den: float, like: Tensor) -> Tensor:
        """``1/den`` as a 0-dim tensor like ``like`` (cached: a loader's microbatches share one size)."""
        key = (den, like.dtype, like.device)
        if self._inverse_key != key:
            self._inverse_key = key
            self._inverse_t = torch.full((), 1.0 / den, dtype=like.dtype, device=like.device)
        return self._inverse_t

    # --- the window's end -----------------------------------------------------------------

    def update(self, ctx: Any) -> UpdateResult | None:
        """Close the window: skip, or unscale -> clip -> step; None when no window is open."""
        window = self.window
        if window.microbatches <= 0:  # no window open
            return None
        names = self._names
        microbatches = window.microbatches
        parallel = self.parallel
        size = parallel.world.size if parallel is not None else 1
        if size > 1:
            assert parallel is not None
            parallel.agree(window, self.grads)  # sets window.global_den: the union's W
        W = window.den if window.global_den is None else window.global_den
        reason, detail, norm = None, "", None
        unscaled = False
        clipped, lrs = False, {}
        if W <= 0:
            window.read()
            reason = "masked"
        else:
            # the window's one host read: its losses with the gradients' finiteness (or norm), after
            # both are formed; read first on their own when a GradScaler must not unscale a window whose
            # loss was not finite, or a stage hook before the step may change the gradients
            if self._read_early or self.scaler is not None:
                before = window.den
                window.read()
                if size == 1:
                    W -= before - window.den  # less the rows of ignored targets, read now
            if window.nonfinite:
                reason, detail = "nonfinite", "a microbatch loss was not finite"
            elif W <= 0:
                reason = "masked"  # every target was ignored
            else:
                reason, detail, norm, clipped, lrs, unscaled = self._step(ctx, W, size)
        if unscaled:
            assert self.scaler is not None
            self.scaler.update()  # after a step, or after an overflow (which lowers the scale)
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        W = window.den if window.global_den is None else window.global_den  # less the ignored rows read since
        loss = window.num / W if W > 0 else math.nan
        local, g = window.den, window.global_den
        counts = {  # the receipt's accounting: this rank's and the union's denominators, the ranks, the bytes moved
            "local_examples": local, "global_examples": local if g is None else g, "data_parallel_size": size,
            "accumulation_steps": self.accumulation, "collective_bytes": window.collective_bytes,
        }
        window.reset()
        return UpdateResult(reason, detail, names, microbatches, loss, norm, clipped, lrs, counts)

    def _step(self, ctx: Any, W: float,
              size: int) -> tuple[str | None, str, float | None, bool, dict[str, list[float]], bool]:
        """Unscale, divide, check, clip and step a window of denominator ``W`` whose losses are finite
        so far; returns (reason, detail, norm, clipped, lrs, unscaled)."""
        window, optimizers = self.window, self.optimizers
        unscaled = False
        if self.scaler is not None:
            for opt in self._optimizers:
                self.scaler.unscale_(opt)
            unscaled = True
        wg = self.grads
        seen = not wg.unseen  # every gradient's layout known before this window (strided() learns new ones)
        grads = wg.strided() if wg.sparse or not seen else list(filter(_IS_SET, map(_GRAD, wg.params)))
        divide_by = 1.0  # the division left to the fused finiteness check (bitwise the same), if any
        if not window.divided:
            if W != size:
                # DDP's all-reduce averaged the ranks' gradients: x size / W is the union's mean
                divisor = W / size if size > 1 else W
                if exact_reciprocal(divisor) and wg.fused_checks and seen and not self._read_early \
                        and self.clip_grad_norm is None and not self.track_grad_norm:
                    # nothing looks at the gradients before the fused check (no norm, no stage hook):
                    # it divides them (WindowGradients.nonfinite_flag), one op less
                    divide_by = divisor
                else:
                    torch._foreach_div_(grads, divisor)
            window.scale = W
        elif window.scale != W:  # divided in backward by a denominator read since to hold ignored rows
            torch._foreach_mul_(grads, window.scale / W)
            window.scale = W
        if self._stages is not None:
            self._stages(TrainingStage.BEFORE_OPTIMIZER_STEP, ctx)
        norm_t = found = None
        if self.clip_grad_norm is not None or self.track_grad_norm:
            # the total L2 norm before clipping (what torch.nn.utils.get_total_norm computes, minus its checks)
            norm_t = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
            flag = norm_t
        else:
            flag, found = wg.nonfinite_flag(grads, divide_by)
        before = window.den
        value = window.read(flag)
        if found is not None and value:
            found.zero_()  # found stays 0 until a check finds a non-finite value
        if size == 1 and window.den != before:
            # the read found rows of ignored targets: the gradients were divided by too many rows
            W -= before - window.den
            if W > 0:
                scale = window.scale / W
                torch._foreach_mul_(grads, scale)
                if norm_t is not None:
                    norm_t, value = norm_t * scale, value * scale  # type: ignore[operator]
        norm = None
        if norm_t is not None:
            norm = value
            finite = math.isfinite(norm)  # type: ignore[arg-type]
        else:
            finite = value is None or (value == 0.0 if found is not None else math.isfinite(value))
        orchestrator = self.orchestrator
        if window.nonfinite:  # read with the gradients' check
            return "nonfinite", "a microbatch loss was not finite", None, False, {}, unscaled
        if not finite:
            return "nonfinite", "a gradient is not finite", norm, False, {}, unscaled
        if W <= 0:
            return "masked", "", None, False, {}, unscaled  # every target was ignored
        if orchestrator is not None and orchestrator.can_veto and orchestrator.vetoed(ctx):
            return "vetoed", "an update hook vetoed the step", norm, False, {}, unscaled
        clipped = self.clip_grad_norm is not None and norm > self.clip_grad_norm  # type: ignore[operator]
        if clipped:
            assert norm_t is not None
            torch.nn.utils.clip_grads_with_norm_(wg.params, self.clip_grad_norm, norm_t)
        lrs = {}
        for n, opt in self._named:
            lrs[n] = list(map(float, map(_LR, opt.param_groups)))  # each group's, as floats
        owner = orchestrator.step_owner if orchestrator is not None else None
        if owner is not None:
            owner.step(ctx, optimizers)
        else:
            for opt in self._optimizers:
                opt.step()
        if orchestrator is not None and orchestrator.has_after_step:
            orchestrator.after_step(ctx)
        return None, "", norm, clipped, lrs, unscaled

