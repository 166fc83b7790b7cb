"""Callbacks: typed no-op hooks dispatched in list order (``on_train_end`` in reverse).

Only hooks a callback implements are dispatched (:func:`implements`: overridden in
its class or assigned on the instance); :class:`CallbackList` decides that once per
fit and dispatches through one typed method per hook. A callback with restart-critical
state returns it from :meth:`Callback.state_dict` (msgpack-able builtins); it is
stored in every checkpoint and given back by :meth:`Callback.load_state_dict` on
resume. A callback that writes its own artifact returns its bytes from
:meth:`Callback.checkpoint`; the trainer stores them as a deferred callback
checkpoint after LAST, BEST and phase (spec 000 "Lifecycle order").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nnx_es.errors import ConfigError

if TYPE_CHECKING:
    from events.schema import UpdateCommitted
    from nnx_es.runtime.context import TrainContext

__all__ = ["HISTORY_ACCESS", "HOOKS", "Callback", "CallbackList", "EarlyStopping", "LambdaCallback", "implements"]


#: what ``ctx.idps`` shows a callback (:attr:`Callback.history_access`)
HISTORY_ACCESS = ("window", "full")


class Callback:
    """Base class: every hook is a no-op; override the ones you need.

    ``distributed``: where the callback runs under data parallelism (``Trainer(distributed=DDP())``):
    ``"all"`` -- on every rank, deciding alike from agreed values (what it asks, e.g. a stop, is
    agreed); ``"writer"`` -- on the writer rank alone (it writes files, logs, talks to a server).
    ``None`` (the base class's): undeclared, refused before training under DDP (see
    :mod:`nnx_es.distributed.roles`). One process runs every callback whatever it declares.

    ``history_access``: what ``ctx.idps`` (the per-row records, :mod:`nnx_es.rows`) shows this
    callback's hooks: ``"window"`` (default) the records in memory -- with a history journal its
    newest ``window`` epochs --, ``"full"`` a reader over the run's whole history (a journal's
    chunks read on demand) and the epoch being closed (spec 000, the history journal).
    """

    distributed: str | None = None
    history_access: str = "window"

    @property
    def name(self) -> str:
        """Stable name used in events and checkpoints (default: class name)."""
        return type(self).__name__

    def on_train_begin(self, ctx: TrainContext) -> None:
        """Once, before the first epoch (in list order)."""

    def on_epoch_begin(self, ctx: TrainContext) -> None:
        """Before each epoch's first microbatch."""

    def on_batch_end(self, ctx: TrainContext) -> None:
        """After each microbatch (and its update, when it closed a window)."""

    def on_optimizer_update(self, ctx: TrainContext, receipt: UpdateCommitted) -> None:
        """After each committed optimizer update, before optimizer_update-clock schedulers step."""

    def on_validation_end(self, ctx: TrainContext, metrics: dict[str, float]) -> None:
        """After each validation pass, with its ``val_`` metrics."""

    def on_epoch_end(self, ctx: TrainContext) -> None:
        """After the epoch's monitor decision and scheduler steps, before its commit."""

    def on_train_end(self, ctx: TrainContext) -> None:
        """Finalization, in reverse list order; runs even when training failed."""

    def state_dict(self) -> dict[str, Any] | None:
        """Restart-critical state (msgpack-able), or ``None`` when stateless."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def checkpoint(self, ctx: TrainContext) -> bytes | None:
        """Bytes of a deferred callback checkpoint for this epoch, or ``None``."""
        return None

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether this class overrides ``hook`` (see :func:`implements` for an instance)."""
        return getattr(cls, hook) is not getattr(Callback, hook)


#: The lifecycle hooks, in lifecycle order: derived from :class:`Callback` itself.
HOOKS: tuple[str, ...] = tuple(name for name in vars(Callback) if name.startswith("on_"))


def implements(cb: Callback, hook: str) -> bool:
    """Whether ``cb`` implements ``hook``: overridden in its class, or assigned on the instance
    (``cb.on_epoch_end = fn``; a :class:`LambdaCallback`'s hooks are such attributes). The one
    rule for dispatch and for finalization."""
    return hook in vars(cb) or type(cb).overrides(hook)


class CallbackList:
    """A run's callbacks, with which of them implements each hook decided once (at construction).

    Dispatch is in list order through one typed method per hook; ``on_train_end`` runs in
    reverse order over the callbacks whose ``on_train_begin`` completed (:attr:`begun`),
    which :meth:`train_begin` records. Follows torchtnt's callback handler.

    Raises:
        ConfigError: an element is not a :class:`Callback`, or two callbacks share a name
            (names key checkpoint state).
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        callbacks = list(callbacks)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"callbacks must be nnx_es.Callback instances, got {type(cb).__name__}")
        names = [cb.name for cb in callbacks]
        if len(set(names)) != len(names):
            raise ConfigError(f"callback names must be unique (they key checkpoint state), got {names}")
        for cb in callbacks:
            if getattr(cb, "history_access", "window") not in HISTORY_ACCESS:
                raise ConfigError(f"callback {cb.name!r} declares history_access={cb.history_access!r}; expected one "
                                  f"of {HISTORY_ACCESS}")
        self.callbacks = callbacks
        # a callback seeing the full history is dispatched through a view setting ctx.idps for its hooks
        views = {id(cb): _FullHistory(cb) for cb in callbacks if cb.history_access == "full"}
        self._view = lambda cb: views.get(id(cb), cb)
        self._by_hook: dict[str, list[Callback]] = {
            hook: [self._view(cb) for cb in callbacks if implements(cb, hook)] for hook in HOOKS
        }
        #: (index, callback) of every callback whose on_train_begin completed, in list order
        self.begun: list[tuple[int, Callback]] = []

    def __iter__(self) -> Any:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    @property
    def names(self) -> list[str]:
        return [cb.name for cb in self.callbacks]

    def has(self, hook: str) -> bool:
        """Whether any callback implements ``hook``."""
        return bool(self._by_hook[hook])

    def train_begin(self, ctx: TrainContext, began: Callable[[int, Callback], Any]) -> None:
        """``on_train_begin`` in list order; ``began(index, cb)`` after each one that completed."""
        self.begun = []
        for i, cb in enumerate(self.callbacks):
            if implements(cb, "on_train_begin"):
                self._view(cb).on_train_begin(ctx)
            began(i, cb)
            self.begun.append((i, cb))

    def epoch_begin(self, ctx: TrainContext) -> None:
        for cb in self._by_hook["on_epoch_begin"]:
            cb.on_epoch_begin(ctx)

    def batch_end(self, ctx: TrainContext) -> None:
        for cb in self._by_hook["on_batch_end"]:
            cb.on_batch_end(ctx)

    def optimizer_update(self, ctx: TrainContext, receipt: UpdateCommitted) -> None:
        for cb in self._by_hook["on_optimizer_update"]:
            cb.on_optimizer_update(ctx, receipt)

    def validation_end(self, ctx: TrainContext, metrics: dict[str, float]) -> None:
        for cb in self._by_hook["on_validation_end"]:
            cb.on_validation_end(ctx, metrics)

    def epoch_end(self, ctx: TrainContext) -> None:
        for cb in self._by_hook["on_epoch_end"]:
            cb.on_epoch_end(ctx)

    def train_end(self, ctx: TrainContext, finalized: Callable[[int, Callback, BaseException | None], Any]) -> None:
        """``on_train_end`` in reverse order over :attr:`begun`; each is attempted, its error (or
        None) handed to ``finalized(index, cb, error)``; no error is raised from here."""
        for i, cb in reversed(self.begun):
            error: BaseException | None = None
            try:
                if implements(cb, "on_train_end"):
                    self._view(cb).on_train_end(ctx)
            except BaseException as exc:  # noqa: BLE001 - every cleanup hook is attempted
                error = exc
            finalized(i, cb, error)

    def checkpoints(self, ctx: TrainContext) -> list[tuple[str, bytes]]:
        """``(name, bytes)`` of every deferred callback checkpoint for this epoch."""
        return [(cb.name, data) for cb in self.callbacks if (data := cb.checkpoint(ctx)) is not None]


class _FullHistory:
    """Dispatches a ``history_access = "full"`` callback's hooks with ``ctx.idps`` the full history."""

    __slots__ = ("cb",)

    def __init__(self, cb: Callback) -> None:
        self.cb = cb

    def __getattr__(self, hook: str) -> Callable[..., Any]:
        fn = getattr(self.cb, hook)

        def call(ctx: TrainContext, *args: Any) -> Any:
            before = ctx.full_history
            ctx.full_history = True
            try:
                return fn(ctx, *args)
            finally:
                ctx.full_history = before

        return call


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda ctx: ...)``.

    ``distributed``: ``"all"`` or ``"writer"`` (see :class:`Callback`); what the functions do is
    yours to declare, so under data parallelism an undeclared one is refused.
    """

    def __init__(self, name: str = "LambdaCallback", distributed: str | None = None, **hooks: Any) -> None:
        unknown = set(hooks) - set(HOOKS)
        if unknown:
            raise ConfigError(f"unknown callback hooks {sorted(unknown)}; known: {HOOKS}")
        if distributed not in (None, "all", "writer"):
            raise ConfigError(f"LambdaCallback(distributed=) must be 'all', 'writer' or None, got {distributed!r}")
        self.distributed = distributed
        self._name = name
        for hook, fn in hooks.items():
            setattr(self, hook, fn)
        self._hooks = set(hooks)

    @property
    def name(self) -> str:
        return self._name

    def has(self, hook: str) -> bool:
        return hook in self._hooks

    def recipe_kwargs(self) -> dict[str, Any]:
        """Its constructor's keywords, for :func:`nnx_es.recipes.to_spec` (the hooks by import path)."""
        out: dict[str, Any] = {"name": self._name}
        if self.distributed is not None:
            out["distributed"] = self.distributed
        return {**out, **{hook: getattr(self, hook) for hook in sorted(self._hooks)}}


class EarlyStopping(Callback):
    """Stop training after ``patience`` epochs without improvement of the run's monitor.

    It reads the epoch's one monitor decision (never the metric itself), so it
    agrees with BEST and ReduceLROnPlateau (Keras / Lightning semantics for
    ``patience``; spec 000 Concepts §6.4 for the single decision).

    Args:
        patience: epochs without improvement tolerated (>= 1).
        min_epochs: never stop before this many epochs have completed.
        monitor: optional; when given it must equal the trainer's monitor name.
    """

    distributed = "all"  # decides from the agreed monitor decision: alike on every rank

    def __init__(self, patience: int = 5, *, min_epochs: int = 0, monitor: str | None = None) -> None:
        if patience < 1:
            raise ConfigError(f"EarlyStopping patience must be >= 1, got {patience!r}")
        self.patience = int(patience)
        self.min_epochs = int(min_epochs)
        self.monitor = monitor
        self.bad_epochs = 0
        self.decision_epoch = -1
        self.stopped_epoch: int | None = None

    def on_train_begin(self, ctx: TrainContext) -> None:
        if ctx.monitor is None:
            raise ConfigError("EarlyStopping needs the trainer's monitor (Trainer(monitor=...))")
        if self.monitor is not None and self.monitor != ctx.monitor.name:
            raise ConfigError(
                f"EarlyStopping(monitor={self.monitor!r}) differs from the trainer's monitor "
                f"{ctx.monitor.name!r}; one decision drives every consumer"
            )

    def on_epoch_end(self, ctx: TrainContext) -> None:
        decision = ctx.decision
        if decision is None or decision.epoch != ctx.epoch:
            return
        self.bad_epochs = decision.bad_epochs
        self.decision_epoch = decision.epoch
        if self.bad_epochs >= self.patience and ctx.epoch + 1 >= self.min_epochs:
            self.stopped_epoch = ctx.epoch
            ctx.request_stop("early_stopping", by=self.name)

    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_epochs": self.bad_epochs,
            "decision_epoch": self.decision_epoch,
            "stopped_epoch": self.stopped_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_epochs = int(state["bad_epochs"])
        self.decision_epoch = int(state["decision_epoch"])
        self.stopped_epoch = state["stopped_epoch"]
