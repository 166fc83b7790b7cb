"""The update engine: microbatches accumulate into a window; the window commits one update.

Per microbatch (:meth:`UpdateEngine.microbatch`)::

    outputs, targets, weights = train_step_fn(net, batch)        # under autocast when enabled
    parts = objective(outputs, targets, weights)                 # numerators + denominator
    backward(parts.total)   (scaled by the GradScaler if any; skipped when den == 0, and, with a
                             GradScaler's backward, when the loss is not finite)
    -> microbatch_done      held: its loss stays on the device until the window's end

Host reads (each stalls an accelerator's queue): none inside a window; at its end one
transfer reads every microbatch's loss (and terms) together with the gradients' finiteness
flag, or their total norm (``torch.stack(...).tolist()``; on the CPU, where a read waits for
nothing, a few values are read one by one instead: :data:`READ_EACH_ON_CPU`): the skip decision,
the held ``microbatch_done`` events' floats, the receipt's loss and the epoch's sums all come from
it, the same floats a read per microbatch gave. With a GradScaler, or a stage hook before
the optimizer step (which may change the gradients), the losses are read first and the
gradients' check after (two reads); a GradScaler's backward reads each microbatch's loss.
``ctx.loss`` is read only when someone reads it (:class:`~nnx_es.context.TrainContext`).

At the window's end (:meth:`UpdateEngine.finalize_step`), in this order
(spec 000 "Lifecycle order" and §3 "One update")::

    W = sum of the window's denominators
    W == 0                      -> update_skipped(masked)     no step, no scheduler step
    a loss was not finite       -> update_skipped(nonfinite)
    unscale (GradScaler) ; coalesce sparse grads ; grad /= W
    a gradient not finite       -> update_skipped(nonfinite)  (the scaler lowers its scale)
                                   (checked from the total L2 norm when it is computed -- with
                                   clipping or ``track_grad_norm`` -- else by one fused check,
                                   which also does the division when its divisor is a power of
                                   two: bitwise the same, one op less; nnx_es.grads)
    an update hook vetoes       -> update_skipped(vetoed)
    clip (max_norm) -> optimizer.step() for every optimizer
    -> update_committed per optimizer (the step receipts: local / global examples, microbatches,
       accumulation steps, data-parallel size, collective bytes -- see _receipt_counts)
    -> on_optimizer_update callbacks see every receipt of the commit
    -> optimizer_update-clock schedulers of those optimizers step
    zero grads

Dividing the accumulated gradient by W makes the update the gradient of the
mean loss over the whole window, with unequal microbatch sizes and masks.

Sparse gradients take the same steps with the same results as the dense gradient they stand
for (coalesced; divided, checked and normed on their values): :mod:`nnx_es.grads`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torch.optim import Optimizer

from events.schema import MicrobatchDone, UpdateSkipped
from nnx_es.batches import split_batch
from nnx_es.callbacks import CallbackList
from nnx_es.errors import ConfigError
from nnx_es.grads import WindowGradients, exact_reciprocal
from nnx_es.metrics import MetricSums
from nnx_es.objective import batch_rows
from nnx_es.objective import LossParts, Objective
from nnx_es.schedulers import Scheduler
from nnx_es.stages import StageDispatcher, TrainingStage
from nnx_es.update_hooks import UpdateHook, UpdateOrchestrator
from nnx_es.engine_ddp import DataParallelWindow
from nnx_es.receipts import Receipts

if TYPE_CHECKING:
    from nnx_es.context import TrainContext
    from nnx_es.rows.recorder import RowRecorder
    from nnx_es.run_state import RunState

__all__ = ["EpochTotals", "UpdateEngine", "default_forward", "default_train_step", "finalize_step", "split_batch"]

StepFn = Callable[[nn.Module, Any], tuple[Tensor, Tensor, Tensor | None]]

#: a window's values on the CPU are read one by one (``Tensor.item``: no stack op, no copy -- on the
#: CPU a read waits for nothing), up to :data:`_READ_EACH_MAX` of them; False: every device's way, one
#: stacked transfer (``torch.stack(...).tolist()``). The floats are the same (tests run both ways).
READ_EACH_ON_CPU = True
_READ_EACH_MAX = 8  # past this many values one stack and one tolist cost less than the reads

_PAIRS = (tuple, list)  # the batch types the default step splits without split_batch (an exact type test)
#: loss dtypes whose float64 sums are multiples of 2**-149: the fused agreement carries them as float32 parts


def default_forward(net: nn.Module, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """The default ``train_step_fn`` and ``eval_step_fn``: ``outputs = net(inputs)``.

    Returns ``(outputs (B, ...), targets (B, ...), weights (B,) or None)``.
    """
    inputs, targets, weights = split_batch(batch)
    return net(inputs), targets, weights


def default_train_step(ctx: TrainContext, batch: Any) -> None:
    """The default ``trainer_step_fn``: one microbatch, and the update when it fills the window."""
    engine = ctx.engine
    if engine._ddp is None:  # engine.microbatch without its data-parallel branch (one call less per microbatch)
        engine._microbatch(ctx, batch)
    else:
        engine.microbatch(ctx, batch)
    if engine.w_microbatches >= engine.accumulation:  # engine.window_full
        engine.finalize_step(ctx)


class EpochTotals:
    """Whole-epoch training sums (for the epoch summary) and window counts."""

    __slots__ = ("sums", "microbatches", "updates", "skipped")

    def __init__(self, metrics: tuple[str, ...] = ()) -> None:
        self.sums = MetricSums(metrics)
        self.microbatches = 0
        self.updates = 0
        self.skipped = 0


class UpdateEngine(DataParallelWindow, Receipts):
    """Accumulates microbatches and commits one optimizer update per window.

    Args:
        net: the model whose parameters the window's gradients belong to.
        optimizers: ``{name: optimizer}``, stepped together once per committed window.
        objective: the loss.
        schedulers: the run's schedulers; those on the ``optimizer_update`` clock step after
            each committed update of their optimizer.
        accumulation: microbatches per window (k >= 1).
        clip_grad_norm: max total L2 norm, or ``None`` for no clipping.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        track_grad_norm: compute the total L2 norm of every window's gradient (before
            clipping) and record it in ``update_committed.grad_norm`` even without
            clipping. Off by default: the norm costs a few small ops per update, and
            without it the receipt's ``grad_norm`` is ``None`` (clipping always computes it).
        metrics: declared metrics summed over the epoch (see :mod:`nnx_es.metrics`).

    The run's own dependencies -- its :class:`~nnx_es.run_state.RunState` (recorder, step
    outcome, world) and its :class:`~nnx_es.callbacks.CallbackList` -- are bound per ``fit``
    by :meth:`begin_run`.

    Raises:
        ConfigError: ``accumulation`` < 1 or ``clip_grad_norm`` <= 0.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizers: dict[str, Optimizer],
        objective: Objective,
        schedulers: list[Scheduler] | None = None,
        *,
        accumulation: int = 1,
        clip_grad_norm: float | None = None,
        precision: str = "fp32",
        train_step_fn: StepFn | None = None,
        track_grad_norm: bool = False,
        metrics: tuple[str, ...] = (),
    ) -> None:
        if accumulation < 1:
            raise ConfigError(f"accumulation must be >= 1 microbatch, got {accumulation!r}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        self.net = net
        self.optimizers = optimizers
        self.objective = objective
        self.update_clock = [s for s in schedulers or () if s.clock == "optimizer_update"]
        self.accumulation = int(accumulation)
        self.clip_grad_norm = clip_grad_norm
        self.train_step_fn = train_step_fn or default_forward
        self.track_grad_norm = bool(track_grad_norm)
        self._inverse_key: tuple[float, torch.dtype, torch.device] | None = None
        self._inverse_t = torch.ones(())
        #: the trainable parameters' gradients at a window's end (layout, finiteness: nnx_es.grads)
        self.grads = WindowGradients([p for p in net.parameters() if p.requires_grad])
        self._params = self.grads.params
        self.orchestrator = UpdateOrchestrator([])
        self.stages = StageDispatcher([])
        self._plan()
        self.set_precision(precision)
        self.metrics = metrics
        self.epoch = EpochTotals()
        self.state: RunState = None  # type: ignore[assignment]  # bound by begin_run
        self.callbacks = CallbackList([])
        self._on_update = False
        #: microbatches whose loss is still on the device: (seq, epoch, batch, rows, den, term names,
        #: whether ignored rows follow, the loss's value when it was read already (else None), loss)
        self._pending: list[tuple[int, int, int, int, float, tuple[str, ...], bool, float | None, Tensor]] = []
        #: their 0-dim values to read, in reading order (loss unless read already, then terms, ignored rows)
        self._pending_t: list[Tensor] = []
        self._ctx: TrainContext | None = None
        #: data parallelism (:meth:`use_ddp`): the DDP wrapper the microbatches run through, or None
        self._ddp: Any = None
        self._forward_net: nn.Module = net
        self._unsynced = False  # the window's last backward ran under no_sync (a trailing short window)
        #: the window's agreement carried by DDP's last gradient bucket (nnx_es.distributed.fused), under DDP
        self._fused: Any = None
        self._syncing = False  # the current microbatch's backward synchronizes the gradients
        self._w_num_t: Tensor | None = None  # the window's numerator on the device (float64), under DDP
        self._grad_bytes = self.grads.nbytes
        #: per-row records of batches carrying row ids (set by the trainer; ``None``: none)
        self.rows: RowRecorder | None = None
        self._reset_window()

    def begin_run(self, state: RunState, callbacks: CallbackList) -> None:
        """Bind the run this engine records into (once per ``fit``)."""
        self.state = state
        self.callbacks = callbacks
        self._on_update = callbacks.has("on_optimizer_update")
        self._pending, self._pending_t = [], []
        state.recorder.settle = self._settle

    def set_precision(self, precision: str, *, init_scale: float = 2.0**16) -> None:
        """``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).

        Raises:
            ConfigError: any other value.
        """
        if precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
        self.precision = precision
        device_type = next((p.device.type for p in self.net.parameters()), "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        #: a new autocast region per microbatch; ``None``: fp32 enters none
        self._autocast: Callable[[], Any] | None = (
            (lambda: torch.autocast(device_type, dtype=dtype)) if precision != "fp32" else None
        )
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale) if precision == "fp16" else None

    def _plan(self) -> None:
        """Decide once per set of stage hooks what every window's end asks (see :meth:`finalize_step`)."""
        #: a stage hook before the step may change the gradients: the losses are read first (two reads)
        self._read_early = self.stages.has(TrainingStage.BEFORE_OPTIMIZER_STEP)

    def use_hooks(self, update_hooks: list[UpdateHook], stage_hooks: list[Any]) -> None:
        """Install update hooks (configured now, folded into one orchestrator) and stage hooks."""
        self.orchestrator = UpdateOrchestrator(update_hooks)
        for h in update_hooks:
            h.configure(self)
        self.stages = StageDispatcher(stage_hooks)
        self._plan()

    # --- window bookkeeping --------------------------------------------------------------

    def _reset_window(self) -> None:
        self.w_microbatches = 0
        self._w_num_t = None
        self._w_float32_sums = True  # every loss of the window is a float32/bf16/fp16 number (DDP's fused agreement)
        self.w_den = 0.0  # this rank's denominator (the receipt's local_examples)
        # The data-parallel seam of the step receipt (spec 003): the DDP path sets the window's
        # denominator summed over the ranks (W of "One update"; None: one process, W = w_den) and
        # adds the bytes its collectives move for the window (gradient all-reduce, agreements)
        # before finalize_step reads them; both go into the window's receipt.
        self.w_global_den: float | None = None
        self.w_collective_bytes = 0
        self.w_num = 0.0  # filled when the window's losses are read (_settle)
        self.w_nonfinite = False
        self.w_divided = False  # the window's gradient already is the mean (one microbatch)
        self.w_scale = 0.0  # what the gradients were divided by when they were (the denominator then known)
        self._w_ign_t: Tensor | None = None  # the window's ignored rows on the device, under DDP

    @property
    def window_open(self) -> bool:
        return self.w_microbatches > 0

    @property
    def window_full(self) -> bool:
        return self.w_microbatches >= self.accumulation

    def begin_epoch(self) -> None:
        if self._pending:  # a custom step left microbatches unread: they belong to the epoch before
            self._settle()
        self.epoch = EpochTotals(self.metrics)
        self.epoch.sums.ignore = self.objective.ignore  # accuracy leaves out what the loss ignores

    # --- one microbatch -------------------------------------------------------------------

    def _microbatch(self, ctx: TrainContext, batch: Any) -> None:
        stages = self.stages if self.stages.by_stage else None
        autocast = self._autocast
        if autocast is None and stages is None:  # _forward inlined: the common case, per microbatch
            step = self.train_step_fn
            if step is default_forward and type(batch) in _PAIRS and len(batch) == 2:  # (inputs, targets)
                targets, weights = batch[1], None
                outputs = self._forward_net(batch[0])
            else:
                outputs, targets, weights = step(self._forward_net, batch)
            ctx.predictions, ctx.targets = outputs, targets
            objective = self.objective
            if objective.scheduled:  # scheduled loss weights: a function of the counters
                objective.at(ctx.step_count, ctx.epoch)
            parts = objective(outputs, targets, weights)
        elif autocast is None:
            outputs, targets, weights, parts = self._forward(ctx, batch, stages)
        else:
            with autocast():
                outputs, targets, weights, parts = self._forward(ctx, batch, stages)
        sums = self.epoch.sums
        if sums.with_accuracy:  # a declared metric that cannot score them: refused before backward
            sums.check(outputs, targets)
        if self.rows is not None:  # per-row records (nnx_es.rows): formed on the device, read at the epoch's close
            self.rows.train_batch(batch, outputs, targets)
        total = parts.total
        den = parts.den
        ign = parts.ignored  # rows of ignored targets (an ignore_index): den - ign is exact, read with the window
        loss_t = total.detach()  # stays on the device: read with the window (see _settle)
        ctx.defer_loss(loss_t, den, ign)
        known = None  # the loss's value, when the host read it already (the DDP agreement staged from the CPU)
        if self._fused is not None:  # DDP: the window's [numerator, W] go with the synchronizing backward
            known = self._stage_agreement(loss_t, den, ign)
        if stages:
            stages(TrainingStage.AFTER_LOSS, ctx)
            stages(TrainingStage.BEFORE_BACKWARD, ctx)
        if den > 0 or self._ddp is not None:  # under DDP every rank takes part in the gradients' all-reduce
            owner = self.orchestrator.backward_owner
            if owner is not None:
                # an owned backward (a GradScaler's) is never handed a non-finite loss: read it now
                if math.isfinite(loss_t.item()):
                    owner.backward(ctx, total)
            elif self.accumulation == 1 and self._ddp is None:
                # a one-microbatch window: its W is this den, so the mean is taken here, not on the
                # grads: backward starts from d(total/den)/d(total) = 1/den (no division op in the graph).
                # A non-finite loss is backpropagated too (no host read to tell): the window's end reads
                # it and skips the update, and its gradients are zeroed unused.
                total.backward(self._inverse(den, total))
                self.w_divided = True
                self.w_scale = den
            else:
                total.backward()
        if stages:
            stages(TrainingStage.AFTER_BACKWARD, ctx)
        self.w_microbatches += 1
        self.w_den += den
        epoch = self.epoch
        epoch.microbatches += 1
        rows = (targets.shape[0] if targets.dim() else 1) if type(targets) is Tensor else batch_rows(targets)
        if sums.scores_rows:
            sums.add_rows(outputs, targets, weights, rows=rows)
        else:
            sums.rows += rows  # all add_rows does when nothing scores the rows
        ctx.rows = rows
        state = self.state
        state.outcome.microbatch_recorded = True
        # held: its loss is filled in when the window's values are read (one transfer, _settle)
        rec = state.recorder
        rec.hold()
        seq = rec.emit(MicrobatchDone(epoch=ctx.epoch, batch=ctx.batch_index, rows=rows, examples=den, loss=math.nan))
        terms = parts.terms
        if known is None:
            self._pending_t.append(loss_t)
        if len(terms) > 1:
            self._pending.append((seq, ctx.epoch, ctx.batch_index, rows, den, tuple(terms), ign is not None, known,
                                  loss_t))
            self._pending_t.extend(terms.values())
        else:
            self._pending.append((seq, ctx.epoch, ctx.batch_index, rows, den, (), ign is not None, known, loss_t))
        if ign is not None:
            self._pending_t.append(ign)
        self._ctx = ctx

    def _forward(self, ctx: TrainContext, batch: Any,
                 stages: StageDispatcher | None) -> tuple[Tensor, Tensor, Tensor | None, LossParts]:
        """``train_step_fn`` and the objective (inside the caller's autocast region, if any)."""
        if stages:
            stages(TrainingStage.BEFORE_FORWARD, ctx)
        outputs, targets, weights = self.train_step_fn(self._forward_net, batch)
        ctx.predictions, ctx.targets = outputs, targets
        if stages:
            stages(TrainingStage.AFTER_FORWARD, ctx)
            stages(TrainingStage.BEFORE_LOSS, ctx)
        objective = self.objective
        if objective.scheduled:  # scheduled loss weights: a function of the counters
            objective.at(ctx.step_count, ctx.epoch)
        return outputs, targets, weights, objective(outputs, targets, weights)

    def _settle(self, flag: Tensor | None = None) -> float | None:
        """Read the pending microbatches' losses (and ``flag``, 0-dim) in one transfer; return ``flag``'s value.

        The one host read of a window: its values fill the held ``microbatch_done`` events, the
        window's numerator and non-finite mark, the epoch's sums (in microbatch order, so every
        float is what a read per microbatch gave) and ``ctx.loss``. Also called by the recorder
        before any write while microbatches are pending (a flush inside a window).
        """
        pending, tensors = self._pending, self._pending_t
        self._pending, self._pending_t = [], []
        if flag is not None:
            if tensors and flag.device != tensors[0].device:
                flag = flag.to(tensors[0].device)
            tensors.append(flag)
        if not pending and not tensors:
            return None
        values: list[float] = []  # none to read when the host read the losses already (a DDP window on the CPU)
        if tensors:
            if READ_EACH_ON_CPU and len(tensors) <= _READ_EACH_MAX and tensors[0].device.type == "cpu":
                # nothing to wait for on the CPU: each value read where it is, no stack op; the floats the
                # stacked read gives (a floating dtype converts to a Python float exactly; anything else is stacked)
                for t in tensors:
                    if not t.is_floating_point():
                        values.clear()
                        break
                    values.append(t.item())
            if not values:
                values = torch.stack(tensors).tolist()  # dtypes promote exactly (fp16/bf16 -> fp32 -> fp64)
        final: dict[int, MicrobatchDone] = {}
        sums = self.epoch.sums
        nan = math.nan
        i = 0
        loss = nan
        for seq, epoch, batch, rows, den, names, ignoring, known, _ in pending:
            if known is None:
                num = values[i]
                i += 1
            else:
                num = known
            terms: dict[str, float] = {}
            nums = {}
            if names:
                nums = dict(zip(names, values[i:i + len(names)]))
                i += len(names)
            if ignoring:  # targets an ignore_index leaves out: the exact denominator
                ignored = values[i]
                i += 1
                den -= ignored
                self.w_den -= ignored
                self._w_ign_t = None  # under DDP: w_den holds them now (the staged W must not subtract them again)
            if names:
                terms = {k: (v / den if den > 0 else nan) for k, v in nums.items()}
                sums.add_loss(num, den, nums)
            else:
                sums.add_loss(num, den)
            if not math.isfinite(num):
                self.w_nonfinite = True
            self.w_num += num
            loss = num / den if den > 0 else nan
            final[seq] = MicrobatchDone(epoch=epoch, batch=batch, rows=rows, examples=den, loss=loss, terms=terms)
        if pending:  # else nothing is held (only a pending microbatch's event is): nothing to release
            if self._ctx is not None:
                self._ctx.settle_loss(pending[-1][-1], loss)
            self.state.recorder.release(final)
        return values[-1] if flag is not None else None

    def _inverse(self, den: float, like: Tensor) -> Tensor:
        """``1/den`` as a 0-dim tensor like ``like`` (cached: a loader's microbatches share one size)."""
        key = (den, like.dtype, like.device)
        if self._inverse_key != key:
            self._inverse_key = key
            self._inverse_t = torch.full((), 1.0 / den, dtype=like.dtype, device=like.device)
        return self._inverse_t

    # --- the window's end -----------------------------------------------------------------

    def finalize_step(self, ctx: TrainContext) -> bool:
        """Close the window: skip, or unscale -> clip -> step -> receipts. Returns True on commit."""
        if self.w_microbatches <= 0:  # no window open
            return False
        optimizers = self.optimizers
        names = list(optimizers)
        microbatches = self.w_microbatches
        size = self.state.world.size
        if size > 1:
            self._agree_window()  # sets w_global_den: the union's W
        W = self.w_den if self.w_global_den is None else self.w_global_den
        reason, detail, norm = None, "", None
        unscaled = False
        clipped, lrs = False, {}
        if W <= 0:
            self._settle()
            reason = "masked"
        else:
            # the window's one host read: its losses with the gradients' finiteness (or norm), after
            # both are formed; read first on their own when a GradScaler must not unscale a window whose
            # loss was not finite, or a stage hook before the step may change the gradients (_plan)
            if self._read_early or self.scaler is not None:
                before = self.w_den
                self._settle()
                if size == 1:
                    W -= before - self.w_den  # less the rows of ignored targets, read now
            if self.w_nonfinite:
                reason, detail = "nonfinite", "a microbatch loss was not finite"
            elif W <= 0:
                reason = "masked"  # every target was ignored
            else:
                if self.scaler is not None:
                    for opt in optimizers.values():
                        self.scaler.unscale_(opt)
                    unscaled = True
                wg = self.grads
                seen = not wg.unseen  # every gradient's layout known before this window (strided() learns new ones)
                grads = wg.strided() if wg.sparse or not seen else [p.grad for p in wg.params if p.grad is not None]
                divide_by = 1.0  # the division left to the fused finiteness check (bitwise the same), if any
                if not self.w_divided:
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
                    self.w_scale = W
                elif self.w_scale != W:  # divided in backward by a denominator read since to hold ignored rows
                    torch._foreach_mul_(grads, self.w_scale / W)
                    self.w_scale = W
                if self.stages.by_stage:
                    self.stages(TrainingStage.BEFORE_OPTIMIZER_STEP, ctx)
                norm_t = found = None
                if self.clip_grad_norm is not None or self.track_grad_norm:
                    # the total L2 norm before clipping (what torch.nn.utils.get_total_norm computes, minus its checks)
                    norm_t = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
                    flag = norm_t
                else:
                    flag, found = self.grads.nonfinite_flag(grads, divide_by)
                before = self.w_den
                value = self._settle(flag)
                if found is not None and value:
                    found.zero_()  # found stays 0 until a check finds a non-finite value
                if size == 1 and self.w_den != before:
                    # the read found rows of ignored targets: the gradients were divided by too many rows
                    W -= before - self.w_den
                    if W > 0:
                        scale = self.w_scale / W
                        torch._foreach_mul_(grads, scale)
                        if norm_t is not None:
                            norm_t, value = norm_t * scale, value * scale  # type: ignore[operator]
                if norm_t is not None:
                    norm = value
                    finite = math.isfinite(norm)
                else:
                    finite = value is None or (value == 0.0 if found is not None else math.isfinite(value))
                if self.w_nonfinite:  # read with the gradients' check
                    reason, detail = "nonfinite", "a microbatch loss was not finite"
                    norm = None
                elif not finite:
                    reason, detail = "nonfinite", "a gradient is not finite"
                elif W <= 0:
                    reason, norm = "masked", None  # every target was ignored
                elif self.orchestrator.can_veto and self.orchestrator.vetoed(ctx):
                    reason, detail = "vetoed", "an update hook vetoed the step"
                else:
                    clipped = self.clip_grad_norm is not None and norm > self.clip_grad_norm
                    if clipped:
                        assert norm_t is not None
                        torch.nn.utils.clip_grads_with_norm_(self._params, self.clip_grad_norm, norm_t)
                    lrs = {n: [float(g["lr"]) for g in optimizers[n].param_groups] for n in names}
                    owner = self.orchestrator.step_owner
                    if owner is not None:
                        owner.step(ctx, optimizers)
                    else:
                        for opt in optimizers.values():
                            opt.step()
                    if self.orchestrator.has_after_step:
                        self.orchestrator.after_step(ctx)
        if unscaled:
            assert self.scaler is not None
            self.scaler.update()  # after a step, or after an overflow (which lowers the scale)
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        loss = self.w_num / W if W > 0 else math.nan
        counts = self._receipt_counts()
        self._reset_window()
        if reason is not None:
            self.epoch.skipped += 1
            self.state.outcome.skipped = reason
            for n in names:
                self.state.recorder.emit(
                    UpdateSkipped(
                        step=ctx.step_count, epoch=ctx.epoch, microbatches=microbatches, reason=reason,
                        optimizer=n, detail=detail, **counts,
                    )
                )
            return False
        self._commit(ctx, names, loss=loss, counts=counts, microbatches=microbatches, grad_norm=norm,
                     clipped=clipped, lrs=lrs)
        if self.stages.by_stage:
            self.stages(TrainingStage.AFTER_OPTIMIZER_STEP, ctx)
        return True


def finalize_step(ctx: TrainContext) -> bool:
    """Close the current accumulation window of ``ctx``'s run (see :class:`UpdateEngine`)."""
    return ctx.engine.finalize_step(ctx)
