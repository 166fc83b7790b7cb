"""Whole-loader prediction and evaluation of a trained net, and recording an evaluation in its run.

* :func:`predict_outputs` runs a net over every batch of a loader (eval mode, no gradients)
  and returns its outputs concatenated over the rows, in loader order.
* :data:`HEADS`: how a net's outputs are read: ``"multiclass"`` (``(N, C)`` logits, C >= 2),
  ``"binary"`` (one logit ``(N, 1)``) or ``"regression"`` (declared: the shapes of a binary head
  and of a one-output regression are the same).
* :func:`record_evaluation` appends an :class:`~events.schema.EvaluationRecorded` to the run
  that produced the weights.

Why the evaluation goes into the source run, after its ``run_finalized`` (and not into a run
of its own): the weights it scores are named by that run's BEST/LAST, so the record belongs
beside them, and a reader of the run (``tools/inspect``) sees it. It is written under the
run's writer lease, once the run is finalized (a live or crashed-unfinished run is refused:
its lifecycle has not ended), as one synced transaction. It belongs to no commit group and
changes no projection: LAST, BEST, history and status read the same with or without it, so
every commit invariant holds (``tools/replay`` checks that its manifest verifies, invariant 4,
and that it follows ``run_finalized``, invariant 2). A stateful resume of the run later
leaves it in the discarded range, in the log for the audit.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from events.log import LmdbLog
from events.schema import EvaluationRecorded, Event
from nnx_es.data import iterate_batches
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.storage import Lease, validate_run_id
from projections.commits import AFTER_RUN_KINDS

__all__ = ["HEADS", "evaluation_event", "input_of", "finalized_log", "predict_outputs", "record_after_run", "record_evaluation",
           "state_fingerprint", "weights_fingerprint"]

#: how a net's outputs are read (``NNModel(head=...)``)
HEADS = ("multiclass", "binary", "regression")


def input_of(batch: Any) -> Any:
    """The inputs of a batch: the batch itself (a tensor), its first element (a tuple or list:
    ``(x,)``, ``(x, y)``, ``(x, y, w)``) or its ``"x"`` (a mapping, :mod:`nnx_es.batches`).

    Raises:
        ConfigError: a mapping without ``"x"`` or an empty sequence.
    """
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, Mapping):
        if "x" not in batch:
            raise ConfigError(f"a batch mapping needs the key 'x' (the inputs), got keys {sorted(batch)}")
        return batch["x"]
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    raise ConfigError(f"a batch is a tensor, (x, ...) or {{'x': ...}}, got {type(batch).__name__}")


@torch.no_grad()
def predict_outputs(net: nn.Module, loader: Iterable[Any], *, device: torch.device | None = None,
                    gather: bool = True, forward: Callable[[nn.Module, Any], Tensor] | None = None) -> Tensor:
    """``net``'s outputs over every batch of ``loader``, concatenated: ``(N, ...)`` float32 on the CPU.

    Runs in eval mode (restored after) without gradients; each batch is moved to ``device``
    (``None``: as it comes). ``forward(net, batch) -> outputs`` replaces ``net(input_of(batch))``.

    Raises:
        ConfigError: a loader with no batch, or a batch :func:`input_of` cannot read.
    """
    was = net.training
    net.eval()
    parts: list[Tensor] = []
    try:
        for batch in iterate_batches(loader, gather=gather, device=device):
            out = forward(net, batch) if forward is not None else net(input_of(batch))
            parts.append(out.detach().float().cpu())
    finally:
        net.train(was)
    if not parts:
        raise ConfigError("the loader yielded no batch: nothing to predict")
    return torch.cat(parts)


def weights_fingerprint(net: nn.Module) -> str:
    """SHA-256 (hex) over ``net``'s state (:func:`state_fingerprint` of its ``state_dict``).

    Says whether the weights in a net are still the ones loaded from a checkpoint (not a
    checkpoint's blob hash: that one hashes the serialized file).
    """
    return state_fingerprint(net.state_dict())


def state_fingerprint(state: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over a ``state_dict``: each key, dtype, shape and bytes, in its order."""
    h = hashlib.sha256()
    for key, value in state.items():
        h.update(key.encode())
        _hash_value(h, value)
    return h.hexdigest()


def _hash_value(h: Any, value: Any) -> None:
    """Feed one state value to ``h``: a tensor's dtype, shape and bytes (a quantized one's integers, scale
    and zero point), a tuple's items in turn (a quantized layer's packed weights), else its ``repr``."""
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.is_quantized:
            h.update(f"{t.q_scale()} {t.q_zero_point()}".encode() if t.qscheme() == torch.per_tensor_affine
                     else repr((t.q_per_channel_scales().tolist(), t.q_per_channel_zero_points().tolist())).encode())
            t = t.int_repr()
        t = t.contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, tuple):
        h.update(f"tuple{len(value)}".encode())
        for item in value:
            _hash_value(h, item)
    else:
        h.update(repr(value).encode())


def record_evaluation(run_dir: str | Path, event: EvaluationRecorded) -> int:
    """Append ``event`` (synced) to the finalized run at ``run_dir``; return its seq (:func:`record_after_run`)."""
    return record_after_run(run_dir, event, "an evaluation")


def record_after_run(run_dir: str | Path, event: Event, what: str = "a record") -> int:
    """Append ``event`` (one of :data:`~projections.commits.AFTER_RUN_KINDS`: an evaluation, an export),
    synced, to the finalized run at ``run_dir``; return its seq. ``what`` names it in errors.

    Raises:
        see :func:`finalized_log`.
    """
    with finalized_log(run_dir, what) as log:
        seq = log.append(event)
        log.flush(sync=True)
        return seq


@contextlib.contextmanager
def finalized_log(run_dir: str | Path, what: str = "a record") -> Iterator[LmdbLog]:
    """The log of the finalized run at ``run_dir``, open for appending an after-run record, under the run's
    writer lease (held until the block ends: nothing else writes the run meanwhile).

    Raises:
        LeaseHeldError: another process writes the run (by this path or another: :mod:`nnx_es.lease`).
        UnsafePathError: its lease file or log is a symbolic link (or of the wrong kind): nothing written.
        ResumeError: the run has no event log, or it is not finalized (its last event is not
            ``run_finalized`` or an earlier after-run record: it is running, or was killed before its end).
    """
    run_dir = Path(run_dir).resolve()
    run_id = validate_run_id(run_dir.name)
    if not (run_dir / "events.lmdb" / "data.mdb").exists():
        raise ResumeError(f"cannot record {what} in {run_dir}: it has no event log")
    with Lease(run_dir.parent, run_id), LmdbLog(run_dir / "events.lmdb") as log:
        last = next(iter(log.read(log.next_seq - 1)), None) if log.next_seq else None
        kind = last[1].KIND if last is not None else None
        if kind != "run_finalized" and kind not in AFTER_RUN_KINDS:
            raise ResumeError(
                f"cannot record {what} in run {run_id!r}: it is not finalized (its last event is {kind!r}; "
                "a running run, or one killed before its end: resume it to its end first)")
        yield log


def evaluation_event(*, name: str, checkpoint: str, manifest: str, epoch: int, weights: str,
                     metrics: Mapping[str, float], examples: int) -> EvaluationRecorded:
    """The event :func:`record_evaluation` appends (the metrics as floats, the wall time now)."""
    return EvaluationRecorded(name=name, checkpoint=checkpoint, manifest=manifest, epoch=epoch, weights=weights,
                              metrics={k: float(v) for k, v in metrics.items()}, examples=int(examples),
                              wall_time_s=time.time())
