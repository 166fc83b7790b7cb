"""Where each callback runs under data parallelism: on every rank, or on the writer alone.

A callback declares ``distributed = "all"`` (it runs on every rank and decides from agreed
values: the monitor decision, the agreed metrics; what it asks for, such as a stop, is agreed
once for all) or ``distributed = "writer"`` (it writes -- files, logs, a tracking server -- and
runs on the writer rank alone). The built-in callbacks are declared; a callback that declares
nothing is refused before training, on every rank, because nnx_es cannot tell whether running
it on every rank would write N times or running it on one would make the ranks decide apart.

:func:`writer_only` builds a writing callback on the writer alone: the other ranks never
call the factory (no file opened, no connection made there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError

__all__ = ["ROLES", "WriterOnly", "check_declared", "for_rank", "writer_only"]

#: what ``Callback.distributed`` may declare
ROLES = ("all", "writer")


class WriterOnly(Callback):
    """A placeholder for the callback ``factory()`` builds on the writer rank alone (:func:`writer_only`).

    The trainer replaces it, when it is built, by ``factory()`` on the writer (and in a single
    process) and drops it on the other ranks.
    """

    distributed = "writer"

    def __init__(self, factory: Callable[[], Callback]) -> None:
        if not callable(factory):
            raise ConfigError(f"writer_only(factory) takes a callable that builds a Callback, got {factory!r}")
        self.factory = factory
        self._built: Callback | None = None

    @property
    def name(self) -> str:
        return f"writer_only({getattr(self.factory, '__qualname__', type(self.factory).__name__)})"

    def build(self) -> Callback:
        """The callback, built once.

        Raises:
            ConfigError: the factory did not return a :class:`~nnx_es.callbacks.Callback`.
        """
        if self._built is None:
            built = self.factory()
            if not isinstance(built, Callback):
                raise ConfigError(f"writer_only: the factory {self.factory!r} returned {built!r}, not a Callback")
            self._built = built
        return self._built


def writer_only(factory: Callable[[], Callback]) -> WriterOnly:
    """Build ``factory()`` on the writer rank alone (``Trainer(callbacks=[writer_only(MyLogger)])``)."""
    return WriterOnly(factory)


def check_declared(callbacks: Sequence[Any], journal: Any = None) -> None:
    """Refuse, under data parallelism, a callback that does not declare where it runs, or one that
    reads a history journal's full history (``history_access = "full"``) on every rank: the journal's
    chunks are on the writer rank alone (the other ranks name them and keep none,
    :class:`~nnx_es.distributed.follower.NamingBlobStore`).

    ``journal``: the trainer's ``history=`` (``None``: records in memory on every rank, which any rank may read).

    Raises:
        ConfigError: naming the first undeclared (or wrongly declared) callback and what to declare.
    """
    for cb in callbacks:
        role = getattr(cb, "distributed", None)
        if role not in ROLES:
            got = "declares nothing" if role is None else f"declares distributed={role!r}"
            raise ConfigError(
                f"callback {getattr(cb, 'name', type(cb).__name__)!r} ({type(cb).__name__}) {got}: under "
                "distributed=DDP() every callback says where it runs -- set the class attribute distributed = "
                "'all' (every rank; it must decide from agreed values such as ctx.decision) or 'writer' (the "
                "writer rank alone: it writes files or logs), or wrap its factory in "
                "nnx_es.distributed.writer_only(...); nothing was trained")
        if journal is not None and role == "all" and getattr(cb, "history_access", "window") == "full":
            raise ConfigError(
                f"callback {getattr(cb, 'name', type(cb).__name__)!r} reads the full history (history_access='full') "
                f"on every rank, but under distributed=DDP() the chunks of history={journal!r} are on the writer "
                "rank alone: declare distributed = 'writer' (it runs on the writer, which reads them), read "
                "history_access='window' (every rank holds the window), or train without history=; nothing was "
                "trained")


def for_rank(callbacks: Sequence[Callback], *, is_writer: bool) -> list[Callback]:
    """The callbacks this rank runs: every ``"all"`` one; ``"writer"`` ones (a :class:`WriterOnly`
    built) on the writer only. A single process is the writer and runs them all."""
    out: list[Callback] = []
    for cb in callbacks:
        if isinstance(cb, WriterOnly):
            if is_writer:
                out.append(cb.build())
        elif getattr(cb, "distributed", None) != "writer" or is_writer:
            out.append(cb)
    return out
