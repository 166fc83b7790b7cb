"""Persistent DataLoader workers re-seeded each epoch, as fresh workers would be.

torch seeds a worker process once, when it starts: from a base seed drawn from the
loader's ``generator`` (the global torch RNG when it has none) as a loader iterator is
created, worker ``w`` gets ``torch.manual_seed(base + w)``, ``random.seed(base + w)`` and
numpy's seed from ``(base, w)`` (``torch.utils.data._utils.worker._worker_loop``). Without
``persistent_workers`` each epoch creates an iterator, hence new workers and a new draw,
so the checkpointed RNG streams determine every epoch's worker streams. With
``persistent_workers=True`` the workers of the first epoch live on and keep drawing from
their streams, while a resumed process starts new ones: the resumed run would see other
random augmentation than the uninterrupted one.

:func:`reseed_workers`, called before each epoch's ``iter(loader)``, makes a persistent
loader draw and seed exactly as a fresh one: its ``worker_init_fn`` is wrapped (before the
workers start) so that each worker, at its first fetch of an epoch after the first,
re-seeds itself from a base seed the main process drew from the loader's generator for
that epoch. A run with ``persistent_workers=True`` is then bitwise the run without it, and
resumes exactly. The user's ``worker_init_fn`` still runs once per worker (not per epoch),
and ``get_worker_info().seed`` stays the first epoch's seed.

The fetch is intercepted through the worker's dataset copy's ``__getitems__`` (torch's map
fetcher calls it for automatic batching). Loaders where that cannot be done --
an ``IterableDataset``, ``batch_size=None``, a dataset without instance attributes -- are
not re-seeded; :func:`worker_seeding_refusal` names why a stateful resume of them cannot be exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.worker import _generate_state

__all__ = ["reseed_workers", "worker_seeding_refusal"]


def _persistent(loader: Any) -> bool:
    return isinstance(loader, DataLoader) and loader.num_workers > 0 and bool(loader.persistent_workers)


def _unsupported(loader: DataLoader) -> str | None:
    """Why the workers of ``loader`` cannot be re-seeded per epoch; None when they can."""
    if isinstance(loader.dataset, IterableDataset):
        return f"its dataset is an IterableDataset ({type(loader.dataset).__name__})"
    if loader.batch_sampler is None:
        return "it has no automatic batching (batch_size=None)"
    if not hasattr(loader.dataset, "__dict__"):
        return f"its dataset ({type(loader.dataset).__name__}) takes no instance attributes"
    return None


def worker_seeding_refusal(loaders: dict[str, Any]) -> str | None:
    """Why a stateful resume with ``loaders`` (role -> loader or None) cannot restore the
    workers' RNG streams -- the first ``persistent_workers=True`` loader whose workers cannot
    be re-seeded per epoch, named with the option and what to do; None when every loader can."""
    for role, loader in loaders.items():
        if _persistent(loader) and (why := _unsupported(loader)) is not None:
            return (f"the {role} loader has persistent_workers=True and {why}, so its workers' RNG streams "
                    "(random augmentation) cannot be re-seeded each epoch and a resumed run would diverge; "
                    "build it with persistent_workers=False to resume exactly")
    return None


def _seed_worker(base_seed: int, worker_id: int) -> None:
    """Seed this worker's RNGs as torch's worker loop seeds a new worker (torch 2.x)."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker_id))


class _Reseeding:
    """A loader's ``worker_init_fn``: wraps the user's and installs the per-epoch re-seed.

    ``shared``: an int64 tensor in shared memory, ``[epoch generation, base seed]``, written
    by the main process before the epoch's iterator is reset, read by the workers.
    """

    def __init__(self, init_fn: Callable[[int], Any] | None) -> None:
        self.init_fn = init_fn
        self.shared = torch.zeros(2, dtype=torch.int64).share_memory_()

    def next_epoch(self, loader: DataLoader) -> None:
        """Draw the epoch's base seed as a new iterator would, for the live workers to seed from."""
        base = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
        self.shared[1] = base
        self.shared[0] += 1

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None, "a worker_init_fn runs in a DataLoader worker"
        dataset, shared = info.dataset, self.shared
        seen = [int(shared[0])]
        own = getattr(dataset, "__getitems__", None)

        def getitems(indices: list[Any]) -> Any:
            generation = int(shared[0])
            if generation != seen[0]:
                seen[0] = generation
                _seed_worker(int(shared[1]), worker_id)
            return own(indices) if own else [dataset[i] for i in indices]

        dataset.__getitems__ = getitems
        if self.init_fn is not None:
            self.init_fn(worker_id)


def reseed_workers(loader: Any) -> None:
    """Before ``iter(loader)`` starts an epoch: make a ``persistent_workers=True`` loader's
    workers draw as fresh ones would (see the module docstring); other loaders are untouched.

    The first call wraps the loader's ``worker_init_fn``; each later call, when the workers
    live on, draws the epoch's base seed from the loader's generator. Workers that started
    without the wrapper, or whose last epoch was not iterated to its end, are shut down
    first, so that the iterator torch creates next starts (and seeds) them afresh.
    """
    if not _persistent(loader) or _unsupported(loader) is not None:
        return
    hook, running = loader.worker_init_fn, getattr(loader, "_iterator", None)
    if running is not None and (not isinstance(hook, _Reseeding) or running._num_yielded != len(loader)):
        # workers started without the hook, or an epoch was left unfinished (the workers may
        # still fetch its batches, drawing from their streams): start them anew, as torch would
        running._shutdown_workers()
        loader._iterator = running = None
    if not isinstance(hook, _Reseeding):
        loader.worker_init_fn = _Reseeding(hook)
    elif running is not None:
        hook.next_epoch(loader)
