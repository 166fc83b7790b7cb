"""``Diagnostics(every=N)``: per-layer gradient, weight, update and activation statistics of a run.

On every N-th committed update (steps N, 2N, ... counted from the run's start, so a resumed
run keeps the cadence) the callback measures, on the device:

* per layer (a module holding parameters of its own; its path in ``net.named_modules()``):
  the L2 norm of the gradients its optimizer stepped with, the L2 norm of its parameters
  before the step, and the update-to-weight ratio ``||after - before|| / ||before||``
  (Karpathy's "ratio of the update magnitudes to the value magnitudes", CS231n "Neural
  Networks Part 3": around 1e-3 is the rule of thumb);
* per activation module (a module of ``torch.nn.modules.activation``: ``ReLU``, ``Tanh``,
  ``GELU``, ...): the mean and standard deviation of its output on one training microbatch,
  and, for the ReLU family, the fraction of dead units: channels (dim 1 of the output,
  PyTorch's ``(N, C, ...)`` layout) not positive on any row of that microbatch (CS231n's
  "dead" ReLUs, which never activate and so never learn).

How it stays off the hot path (the host-sync budget, ``tests/integration/test_host_syncs.py``):
the gradient and weight statistics come from ``torch.optim.Optimizer`` step pre-/post-hooks
(public PyTorch hooks, called once per ``optimizer.step()``: per committed update, never per
microbatch) and are only computed on the cadence; the activation statistics from forward
hooks registered for one microbatch (armed after the update before a recorded one, removed
when they fire); every value stays on the device, stacked per recorded update, until the
epoch's end, where one ``.tolist()`` reads all of the epoch's records at once and each
becomes a ``diagnostics_recorded`` event (:class:`events.schema.DiagnosticsRecorded`),
written before ``history_appended`` so the epoch's LAST commits them. No host read happens
inside an epoch; runs without the callback write nothing new (their logs are unchanged).

Why events and not a file of rows: the log is the run's single source of truth (DESIGN.md);
events get the committed view for free -- the records of an epoch a crash cut short stay in
the ignored tail and are never mixed with the resumed run's -- and ``nnx-es inspect``,
``tools/replay`` and the projections read them like any other event. A record is a few
dozen floats; at one per N updates the log grows by far less than its ``microbatch_done``
events already make it grow.

Cost on the cadence: one clone of the parameters (for the update's size) and a few fused
norm kernels; off the cadence, two Python calls per optimizer step. Measured in
``docs/guides/diagnostics.md``.

Not yet under ``distributed=DDP()``: the callback declares no ``distributed`` role, so a
data-parallel trainer refuses it before training (each rank would measure its own microbatch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from events.schema import DiagnosticsRecorded
from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError

if TYPE_CHECKING:
    from events.schema import UpdateCommitted
    from nnx_es.runtime.context import TrainContext

__all__ = ["RELU_FAMILY", "ROOT", "Diagnostics", "activation_modules", "parameter_layers"]

#: the layer name of parameters the net holds itself (not in a submodule)
ROOT = "<root>"

#: activation modules whose dead units are counted: a unit is dead when it is not positive on any row
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU)

#: modules of ``torch.nn.modules.activation`` that are not elementwise activations of a layer's output
_NOT_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d,
)


def parameter_layers(net: nn.Module, trained: set[int] | None = None) -> list[tuple[str, list[nn.Parameter]]]:
    """``[(module path, its own parameters)]`` in ``named_modules`` order: every module holding
    parameters directly (``recurse=False``), each parameter under its first owner (tied weights
    once); ``"<root>"`` for the net's own. ``trained``: only the parameters whose ``id`` is in it
    (those an optimizer steps; a frozen layer has no update to diagnose)."""
    seen: set[int] = set()
    out: list[tuple[str, list[nn.Parameter]]] = []
    for path, module in net.named_modules():
        own = [p for _, p in module.named_parameters(recurse=False)
               if id(p) not in seen and (trained is None or id(p) in trained)]
        seen.update(id(p) for p in own)
        if own:
            out.append((path or ROOT, own))
    return out


def activation_modules(net: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``[(module path, module, whether its dead units are counted)]``: the net's modules of
    ``torch.nn.modules.activation`` (attention and softmax modules left out), ReLU family marked."""
    out = []
    for path, module in net.named_modules():
        if type(module).__module__ == "torch.nn.modules.activation" and not isinstance(module, _NOT_ACTIVATIONS):
            out.append((path or ROOT, module, isinstance(module, RELU_FAMILY)))
    return out


def _norms(tensors: list[Tensor]) -> Tensor:
    """The L2 norm of each tensor, as one float32 vector ``(len(tensors),)`` on the first one's device; fused
    where the tensors allow it (a sparse one by its values)."""
    if any(t.is_sparse for t in tensors):
        norms = [torch.linalg.vector_norm(t.coalesce().values() if t.is_sparse else t) for t in tensors]
    else:
        norms = list(torch._foreach_norm(tensors))
    try:
        return torch.stack(norms).float()
    except RuntimeError:  # parameters on several devices
        return torch.stack([n.to(norms[0].device, torch.float32) for n in norms])


class _Update:
    """One recorded update in the making: per optimizer, its parameters' norms (vectors on the device)."""

    __slots__ = ("step", "parts", "before")

    def __init__(self, step: int) -> None:
        self.step = step  # the update's 1-based step
        #: optimizer id -> [parameter indices (int64), gradient norms, weight norms, update norms or None]
        self.parts: dict[int, list[Any]] = {}
        #: optimizer id -> (its parameters, their values before the step)
        self.before: dict[int, tuple[list[Tensor], list[Tensor]]] = {}


class Diagnostics(Callback):
    """Record per-layer training diagnostics every ``every`` committed updates (see the module docstring).

    Args:
        every: the cadence, in committed updates (int >= 1): steps ``every``, ``2 * every``, ...
        activations: also record activation statistics and dead units (forward hooks on one
            microbatch per recorded update); ``False``: gradients and weights only.

    Each recorded update becomes a ``diagnostics_recorded`` event at its epoch's end; read them
    with ``nnx-es diagnose RUN`` or :func:`nnx_es.diagnose`.

    Raises:
        ConfigError: ``every`` is not an int >= 1 (at construction).
    """

    def __init__(self, every: int = 10, *, activations: bool = True) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"Diagnostics(every=) takes the cadence in committed updates, an int >= 1; got "
                              f"{every!r}")
        self.every = every
        self.activations = bool(activations)
        self._ctx: TrainContext | None = None
        self._layer_names: list[str] = []
        self._param_index: dict[int, int] = {}  # id(param) -> parameter index
        self._index: Tensor | None = None  # parameter index -> layer index (int64, on the device)
        self._device = torch.device("cpu")
        self._activations: list[tuple[str, nn.Module, bool]] = []
        self._handles: list[Any] = []  # optimizer hooks
        self._forward: list[Any] = []  # armed forward hooks
        self._acts: dict[str, tuple[Tensor, bool]] = {}  # captured: path -> (stats, whether dead is counted)
        self._update: _Update | None = None
        self._seen = -1  # the step of the last receipt handled
        #: the epoch's records, on the device: (epoch, step, layer values, activation names, activation values)
        self._pending: list[tuple[int, int, Tensor, list[tuple[str, bool]], Tensor | None]] = []

    # --- the run ---------------------------------------------------------------------------

    def on_train_begin(self, ctx: TrainContext) -> None:
        self._ctx = ctx
        trained = {id(p) for opt in ctx.optimizers.values() for g in opt.param_groups for p in g["params"]}
        layers = parameter_layers(ctx.net, trained)
        self._layer_names = [name for name, _ in layers]
        self._param_index = {}
        owners: list[int] = []
        for li, (_, params) in enumerate(layers):
            for p in params:
                self._param_index[id(p)] = len(owners)
                owners.append(li)
        self._device = next((p.device for p in ctx.net.parameters()), torch.device("cpu"))
        self._index = torch.tensor(owners, dtype=torch.int64, device=self._device)
        self._activations = activation_modules(ctx.net) if self.activations else []
        self._pending, self._acts, self._update, self._seen = [], {}, None, -1
        for opt in ctx.optimizers.values():
            self._handles.append(opt.register_step_pre_hook(self._before_step))
            self._handles.append(opt.register_step_post_hook(self._after_step))
        if self._due(ctx.step_count + 1):
            self._arm()

    def on_optimizer_update(self, ctx: TrainContext, receipt: UpdateCommitted) -> None:
        if receipt.step == self._seen:  # the update's other receipts (one per optimizer)
            return
        self._seen = receipt.step
        update, self._update = self._update, None
        if update is not None and update.step == receipt.step:
            self._pending.append(self._assemble(ctx.epoch, receipt.step, update))
        self._disarm()  # an activation module the update's microbatches never ran
        if self._due(receipt.step + 1):
            self._arm()  # the next update is recorded: its first microbatch's activations

    def on_epoch_end(self, ctx: TrainContext) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        parts = [t for _, _, layers, _, acts in pending for t in ((layers,) if acts is None else (layers, acts))]
        values = torch.cat(parts).tolist()  # the epoch's one host read of its diagnostics
        names = self._layer_names
        n = len(names)
        i = 0
        emit = ctx.state.recorder.emit
        for epoch, step, _, act_names, _ in pending:
            grad, weight, ratio = values[i:i + n], values[i + n:i + 2 * n], values[i + 2 * n:i + 3 * n]
            i += 3 * n
            mean: dict[str, float] = {}
            std: dict[str, float] = {}
            dead: dict[str, float] = {}
            for name, counted in act_names:
                mean[name], std[name] = values[i], values[i + 1]
                if counted:
                    dead[name] = values[i + 2]
                i += 3
            emit(DiagnosticsRecorded(
                epoch=epoch, step=step, grad_norm=dict(zip(names, grad)), weight_norm=dict(zip(names, weight)),
                update_ratio=dict(zip(names, ratio)), activation_mean=mean, activation_std=std, dead_fraction=dead,
            ))

    def on_train_end(self, ctx: TrainContext) -> None:
        for handle in (*self._handles, *self._forward):
            handle.remove()
        self._handles, self._forward = [], []
        self._pending, self._acts, self._update, self._ctx, self._activations = [], {}, None, None, []

    # --- the cadence -----------------------------------------------------------------------

    def _due(self, step: int) -> bool:
        return step % self.every == 0

    # --- gradients and weights: optimizer step hooks ------------------------------------------

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ctx = self._ctx
        if ctx is None or not self._due(ctx.step_count + 1):
            return
        update = self._update
        if update is None or update.step != ctx.step_count + 1:  # (a step a custom trainer_step_fn never reported)
            update = self._update = _Update(ctx.step_count + 1)
        index = self._param_index
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in index]
        if not params:
            return
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in params]
            at = torch.tensor([index[id(p)] for p in params], dtype=torch.int64, device=self._device)
            update.parts[id(opt)] = [at, _norms(grads), _norms([p.detach() for p in params]), None]
            update.before[id(opt)] = (params, [p.detach().clone() for p in params])

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        update = self._update
        if update is None or id(opt) not in update.before:
            return
        params, before = update.before.pop(id(opt))
        with torch.no_grad():
            update.parts[id(opt)][3] = _norms(torch._foreach_sub([p.detach() for p in params], before))

    def _assemble(self, epoch: int, step: int, update: _Update) -> tuple[int, int, Tensor, list[tuple[str, bool]],
                                                                          Tensor | None]:
        """The recorded update's values, stacked on the device: per-layer gradient, weight and ratio (3 * L), and
        the captured activations' [mean, std, dead] (3 per module)."""
        assert self._index is not None
        index, device = self._index, self._device
        with torch.no_grad():
            norms = torch.zeros(3, len(index), dtype=torch.float32, device=device)  # gradient, weight, update
            for at, grad, weight, delta in update.parts.values():
                if delta is None:  # the optimizer's step hook never came back (it raised)
                    continue
                norms[:, at] = torch.stack([grad, weight, delta]).to(device)
            layers = torch.zeros(3, len(self._layer_names), dtype=torch.float32, device=device)
            layers = layers.index_add_(1, index, norms.square()).sqrt()
            grad, weight, delta = layers
            ratio = torch.where(weight > 0, delta / weight, torch.full_like(weight, math.nan))
            values = torch.cat([grad, weight, ratio])
            acts, self._acts = self._acts, {}
            names = [(name, counted) for name, (_, counted) in acts.items()]
            stacked = torch.cat([stats.to(device) for stats, _ in acts.values()]) if acts else None
        return epoch, step, values, names, stacked

    # --- activations: one-shot forward hooks --------------------------------------------------

    def _arm(self) -> None:
        for path, module, counted in self._activations:
            self._forward.append(module.register_forward_hook(self._capture(path, counted)))

    def _capture(self, path: str, counted: bool) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not module.training or not isinstance(output, Tensor) or not output.is_floating_point():
                return  # a validation pass, or an output that is not one tensor
            if path in self._acts:
                return
            with torch.no_grad():
                y = output.detach()
                f = y.float()
                mean, std = f.mean(), f.std(correction=0)
                if counted and y.dim() >= 2 and y.shape[0] > 0:
                    dims = [d for d in range(y.dim()) if d != 1]
                    alive = f.amax(dim=dims) > 0
                    dead = 1.0 - alive.float().mean()
                else:
                    dead = torch.zeros((), device=y.device)
                self._acts[path] = (torch.stack([mean, std, dead.float()]), counted and y.dim() >= 2)
            if len(self._acts) == len(self._forward):  # every armed module fired: no hook stays
                self._disarm()
        return hook

    def _disarm(self) -> None:
        for handle in self._forward:
            handle.remove()
        self._forward = []
