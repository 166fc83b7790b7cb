"""What failed on another rank: each failing rank posts its error to the group's store.

When one rank raises (a callback's error, a bad batch), it leaves the group; the others learn
of it only as their next collective breaks -- gloo's "Connection closed by peer", or a timeout --
and the writer rank, the only one whose log is kept, would record that symptom alone. So every
rank that fails posts ``"<class>: <message>"`` to the process group's key-value store (the one
``torchrun`` started the group with: it outlives a rank) under the run's session and its rank, and a
rank recording its own failure reads what the others posted, without waiting: the writer's
``run_failed`` then leads with the cause (:func:`cause_first`, :class:`~nnx_es.runtime.finalize.Finalization`)
-- its class and message first, this rank's symptom after -- so ``inspect summary`` shows it first.
Nothing here raises: a store that cannot be reached leaves the record as it was.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cause_first", "peer_failures", "post_failure"]

_LIMIT = 2000  # characters of a posted error


def _store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _key(session: str, rank: int) -> str:
    return f"nnx_es/failed/{session}/{rank}"


def post_failure(world: Any, session: str, exc: BaseException) -> None:
    """Post this rank's ``exc`` for the others to read; ``session``: the run's id and this session's opening
    seq, alike on every rank (a failed fit and its resume in one group do not read each other's). One
    process, or no store: nothing."""
    if not world.distributed:
        return
    try:
        store = _store()
        if store is not None:
            store.set(_key(session, world.rank), f"{type(exc).__name__}: {exc}"[:_LIMIT])
    except Exception:  # noqa: BLE001 - a diagnosis, never a second failure
        pass


def peer_failures(world: Any, session: str) -> list[str]:
    """``"rank R: <class>: <message>"`` for every other rank that posted a failure in ``session``, in rank
    order, read without waiting (``[]`` in one process, or when the store cannot be reached)."""
    if not world.distributed:
        return []
    out = []
    try:
        store = _store()
        if store is None:
            return []
        for rank in range(world.size):
            key = _key(session, rank)
            if rank != world.rank and store.check([key]):
                out.append(f"rank {rank}: {store.get(key).decode(errors='replace')}")
    except Exception:  # noqa: BLE001 - a diagnosis, never a second failure
        return out
    return out


def cause_first(own_type: str, own_message: str, rank: int, others: list[str]) -> tuple[str, str]:
    """The ``(error_type, message)`` of a failure record that leads with the cause: the first of
    ``others`` (:func:`peer_failures`' ``"rank R: <class>: <message>"``, in rank order), then this
    rank's own error (``own_type``, ``own_message``: mostly the broken group's symptom, gloo's
    "Connection closed by peer" or a timeout) and any further ranks'. Without ``others``: this
    rank's own, unchanged.

    A rank that posted its failure left the group when it failed; this rank reads the posts only as
    its own failure is recorded, so a posted failure is taken to precede this rank's.
    """
    if not others:
        return own_type, own_message
    head, rest = others[0], others[1:]
    where, _, error = head.partition(": ")
    cause_type, sep, cause_message = error.partition(": ")
    if not sep:  # not "<class>: <message>": the whole text is the message
        cause_type, cause_message = "RuntimeError", error
    also = "".join(f"; then {r}" for r in rest)
    return cause_type, (f"{cause_message} [{where} failed first{also}; then rank {rank}: "
                        f"{own_type}: {own_message}]")
