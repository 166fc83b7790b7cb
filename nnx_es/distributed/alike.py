"""Every rank runs the same recipe: the ranks compare what each declares before training.

Data parallelism is correct only when every rank trains the same thing: the same loss and its
arguments, optimizers and their hyperparameters, schedulers, window, precision and clipping,
callbacks that run on every rank, epochs, data. Each rank builds its own trainer, so a setting
read from the environment, a branch on the rank, or a different file on another host makes one
rank train something else; the gradients of two different objectives are then averaged and the
run completes on them (or one rank ends its epochs early and the other hangs until the group's
timeout). No peer trainer checks this; the divergence digest (:mod:`nnx_es.distributed.digest`)
sees it only in the weights, and only for what moves them.

:func:`check_alike` gathers each rank's declaration once (one all-gather) and refuses, on every
rank alike, a field that differs, naming it and each rank's value. Only what differs between
ranks by design is left out: the callbacks that run on the writer alone, a rank's own shard
of the validation rows (its length), the library versions (they are compared and a difference
is logged: hosts may differ in a patch release).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec
import structlog

from nnx_es.errors import ConfigError

__all__ = ["check_alike", "data_fingerprint"]

log = structlog.get_logger("nnx_es.distributed")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs per process, not per recipe
_SAMPLES = 8  # rows of a tensor data set hashed at evenly spaced positions


def _plain(value: Any) -> Any:
    """``value`` as JSON-able builtins without memory addresses (what two processes can compare)."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return _ADDRESS.sub("", value) if isinstance(value, str) else value
    import torch

    if isinstance(value, torch.Tensor):  # its values, not its repr: a device (cuda:0, cuda:1) differs by rank
        return value.detach().cpu().tolist() if value.numel() <= 64 else [str(value.dtype), list(value.shape)]
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a NumPy scalar
        return value.item()
    return _ADDRESS.sub("", repr(value))


def data_fingerprint(dataset: Any) -> str | None:
    """A short hash of a tensor data set (``TensorDataset``; a ``Subset``'s is its whole data set's, since a
    rank's own shard differs by design): its length, its tensors' dtypes and shapes, and :data:`_SAMPLES`
    rows at evenly spaced positions; ``None`` for any other data set (its ``__getitem__`` may decode files
    or draw augmentations: it is not called)."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if not isinstance(dataset, TensorDataset) or not dataset.tensors:
        return None
    n = len(dataset.tensors[0])
    h = hashlib.blake2b(digest_size=8)
    h.update(str(n).encode())
    rows = sorted({(n - 1) * k // (_SAMPLES - 1) for k in range(_SAMPLES)}) if n > 0 else []
    for t in dataset.tensors:
        h.update(f"{t.dtype}:{tuple(t.shape[1:])};".encode())
        for r in rows:
            h.update(t[r].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_alike(world: Any, declared: dict[str, Any], *, versions: dict[str, str] | None = None) -> None:
    """Refuse, on every rank alike, a run whose ranks declare it differently (see the module docstring).

    Args:
        world: the run's world (:class:`~nnx_es.run_state.World`); one process: nothing is checked.
        declared: this rank's declaration, by field (any values: compared as builtins, memory
            addresses in a repr left out).
        versions: this rank's library versions: a difference is logged, not refused.

    Raises:
        ConfigError: naming every field that differs and each rank's value (shortened), before
            anything is trained or written.
    """
    if world.size <= 1:
        return
    mine = {k: _plain(v) for k, v in declared.items()}
    digests = {k: hashlib.sha256(msgspec.json.encode(v, order="deterministic")).hexdigest()[:16]
               for k, v in mine.items()}
    everyone = world.gather({"digests": digests, "versions": versions or {}})
    differ = sorted(k for k in digests if len({r["digests"].get(k) for r in everyone}) > 1)
    ranks_versions = [r["versions"] for r in everyone]
    if any(v != ranks_versions[0] for v in ranks_versions):
        log.warning("the ranks' library versions differ", versions=ranks_versions, rank=world.rank)
    if not differ:
        return
    # the values, for the message: gathered only now (a refusal), the same message on every rank
    values = world.gather({k: mine[k] for k in differ})
    parts = []
    for k in differ:
        shown = "; ".join(f"rank {r}: {_short(v[k])}" for r, v in enumerate(values))
        parts.append(f"{k} ({shown})")
    raise ConfigError(
        f"the ranks do not declare the same run: {', '.join(parts)}; every rank must build the same trainer "
        "and call fit with the same arguments on the same data (a setting that depends on the rank, the host or "
        "the environment trains something else on one rank, and the averaged gradients mix them); nothing was "
        "trained or written")


def _short(value: Any, limit: int = 160) -> str:
    text = msgspec.json.encode(value, order="deterministic").decode()
    return text if len(text) <= limit else text[:limit - 3] + "..."
