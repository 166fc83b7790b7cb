"""The batch contract: what the default step functions read from a batch.

A batch the default ``train_step_fn`` / ``eval_step_fn`` reads is one of:

``(inputs, targets)`` (a tuple or a list, as a ``DataLoader`` over a ``TensorDataset`` yields)
    ``net(inputs)`` is scored against ``targets``; every row has weight 1.
``(inputs, targets, weights)``
    only when weights are declared: ``Trainer(..., sample_weights=True)`` (or
    ``NNModel.train(..., sample_weights=True)``). ``weights`` is float or int, shape ``(B,)``,
    >= 0: each row's loss counts ``weights[i]`` times in the mean, and a row of weight 0 is
    masked out (a window whose every row is masked is skipped, ``update_skipped(masked)``).
    Without the declaration a third element is refused: an id or index column would
    otherwise silently become per-row loss weights. With it, a 2-tuple still means all 1.
``(inputs, targets, weights, row_ids)``
    with ``sample_weights=True``: the fourth element is the rows' ids (below).
a mapping with keys ``"x"``, ``"y"`` and optionally ``"weight"`` and ``"idx"``
    the same as ``(x, y)`` or ``(x, y, weight)``: the ``"weight"`` key is itself the
    declaration. Any other key is refused, so a misspelt ``"weights"`` is not ignored.

Row ids (``"idx"``, or a 4-tuple's last element) are integers, shape ``(B,)``, naming each
row of the data set -- stable across epochs, unique within one -- so that per-row records
(:mod:`nnx_es.rows`) are keyed by ``(row id, epoch)``, never by batch position. They never
enter the loss. :func:`nnx_es.rows.with_row_ids` adds them to a ``TensorDataset``.

Anything else is refused. A step function of your own (``train_step_fn``,
``eval_step_fn``) reads any batch it likes and returns ``(outputs, targets, weights or
None)``; the loss then checks the weights' shape and sign (:mod:`nnx_es.objective`).

Every refusal is a :class:`~nnx_es.errors.ConfigError` that names what was received and
how to declare what was meant; it is raised on the first batch, before any backward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from nnx_es.errors import ConfigError

__all__ = ["BATCH_KEYS", "ROW_ID_KEY", "row_ids_of", "split_batch", "weighted_forward"]

#: the key of a mapping batch holding the rows' ids
ROW_ID_KEY = "idx"
#: the keys a mapping batch may have
BATCH_KEYS = ("x", "y", "weight", ROW_ID_KEY)

_DECLARE = ("declare per-row loss weights with Trainer(..., sample_weights=True) (or NNModel.train(..., "
            "sample_weights=True)) or yield {'x': ..., 'y': ..., 'weight': ...}; to carry anything else "
            "(ids, metadata), pass a train_step_fn/eval_step_fn that reads your batch")


def split_batch(batch: Any, *, sample_weights: bool = False) -> tuple[Any, Tensor, Tensor | None]:
    """Split a batch by the contract above into ``(inputs, targets, weights or None)``.

    Args:
        batch: ``(inputs, targets)``, ``(inputs, targets, weights)`` (with ``sample_weights``),
            or a mapping with ``"x"``, ``"y"`` and optionally ``"weight"``.
        sample_weights: a third element of a tuple/list batch is per-row weights ``(B,)``.

    Raises:
        ConfigError: a third element without ``sample_weights`` (the message says how to
            declare it), a mapping with other keys or without ``"x"``/``"y"``, or any other
            kind or length of batch.
    """
    kind = type(batch)
    if kind is tuple or kind is list or isinstance(batch, (tuple, list)):  # the common case first (no ABC check)
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            if sample_weights:
                return batch[0], batch[1], batch[2]
            third = batch[2]
            what = f"{type(third).__name__} of shape {tuple(third.shape)}" if isinstance(third, Tensor) else (
                type(third).__name__)
            raise ConfigError(
                f"a batch has a third element ({what}) but no per-row weights were declared, so it would be "
                f"ignored or misread; {_DECLARE}"
            )
        if len(batch) == 4:
            if sample_weights:
                return batch[0], batch[1], batch[2]
            raise ConfigError(
                "a batch has four elements (inputs, targets, weights, row ids), which needs sample_weights=True; "
                "without weights yield {'x': ..., 'y': ..., 'idx': ...} (nnx_es.rows.with_row_ids does)"
            )
    elif isinstance(batch, Mapping):
        extra = sorted(map(str, set(batch) - set(BATCH_KEYS)))
        if "x" in batch and "y" in batch and not extra:
            return batch["x"], batch["y"], batch.get("weight")
        raise ConfigError(
            f"a mapping batch must have the keys 'x', 'y' and optionally 'weight' and 'idx', got keys {sorted(map(str, batch))}"
            + (f" ({', '.join(map(repr, extra))} would be ignored)" if extra else "")
            + "; to read other keys, pass a train_step_fn/eval_step_fn"
        )
    raise ConfigError(
        "a batch must be (inputs, targets), (inputs, targets, weights[, row_ids]) with sample_weights=True, or a "
        f"mapping with 'x', 'y'[, 'weight'][, 'idx']; got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def row_ids_of(batch: Any) -> Tensor | None:
    """The row ids a batch carries by the contract above, or ``None``.

    A mapping's ``"idx"``, or the fourth element of a 4-element tuple/list. Not checked here
    (:class:`nnx_es.rows.RowRecorder` checks dtype and shape against the batch's rows).
    """
    kind = type(batch)
    if kind is tuple or kind is list or isinstance(batch, (tuple, list)):  # first: the common case (no ABC check)
        return batch[3] if len(batch) == 4 else None
    if isinstance(batch, Mapping):
        return batch.get(ROW_ID_KEY)
    return None


def weighted_forward(net: nn.Module, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """The default step function with declared weights (``sample_weights=True``): ``net(inputs)``.

    Returns ``(outputs (B, ...), targets (B, ...), weights (B,) or None)``.

    Raises:
        ConfigError: see :func:`split_batch`.
    """
    inputs, targets, weights = split_batch(batch, sample_weights=True)
    return net(inputs), targets, weights
