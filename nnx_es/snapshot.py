"""A trainer's restart-critical state as checkpoint components, and back.

:func:`capture` builds the components of one checkpoint from a live trainer;
:func:`load_state` reads every component of a verified manifest with the safe
loaders (nothing is applied until all of them loaded); :func:`apply_state`
puts them into a trainer. Components (see :mod:`nnx_es.checkpoint`)::

    model, optimizer/<name>, scheduler/<name>, scaler, update_hook/<name>   tensors (or torch)
    schedulers, monitor, rng, data, topology, callback/<name>               msgpack
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import Tensor, nn

from nnx_es.checkpoint import Manifest, load_component, torch_bytes
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.rng import capture_rng, generators_mismatch, restore_rng
from nnx_es.state_codec import encode_state
from nnx_es.storage import BlobStore
from nnx_es.update_hooks import EMA

if TYPE_CHECKING:
    from nnx_es.trainer import Trainer

__all__ = ["apply_state", "capture", "detached_copy", "encode_parts", "load_state", "weight_misfits"]

_msgpack = msgspec.msgpack.Encoder()


def detached_copy(obj: Any) -> Any:
    """A copy of a state dict that later training cannot change: every tensor is
    detached and cloned, every dict/list/tuple rebuilt (other leaves are shared)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: detached_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [detached_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(detached_copy(v) for v in obj)
    return obj


def _state_part(state: Any) -> tuple[str, Any]:
    """A state dict as a ``"tensors"`` component (encoded now: raw bytes, a snapshot), or, when that
    codec cannot hold it, a ``"torch"`` one (a detached copy, ``torch.save``-d by :func:`encode_parts`)."""
    data = encode_state(state)
    return ("tensors", data) if data is not None else ("torch", detached_copy(state))


def capture(trainer: Trainer, epoch: int) -> dict[str, tuple[str, Any]]:
    """Components of a checkpoint holding ``trainer`` after 0-based ``epoch`` (-1: before training).

    Cheap, on the training thread: state dicts are encoded with the ``"tensors"`` codec
    (:mod:`nnx_es.state_codec`: raw tensor bytes, microseconds for a small model), or kept
    as detached copies for ``torch.save`` by :func:`encode_parts` (off the training thread
    when the commit is deferred) when that codec cannot hold them; ``"msgpack"``
    components are encoded here.
    """
    parts: dict[str, tuple[str, Any]] = {"model": _state_part(trainer.net.state_dict())}
    for n, o in trainer.optimizers.items():
        parts[f"optimizer/{n}"] = _state_part(o.state_dict())
    for s in trainer.schedulers:
        parts[f"scheduler/{s.name}"] = _state_part(s.state_dict())
    if trainer.engine.scaler is not None:
        parts["scaler"] = _state_part(trainer.engine.scaler.state_dict())
    for h in trainer.update_hooks:
        if isinstance(h, EMA):
            parts[f"update_hook/{h.name}"] = _state_part(h.torch_state())
    state = {
        "schedulers": {s.name: s.summary() for s in trainer.schedulers},
        "monitor": trainer.monitor.state_dict() if trainer.monitor else None,
        "rng": capture_rng(trainer.generators),
        "data": {"next_epoch": epoch + 1},
        "topology": {
            "module": type(trainer.net).__qualname__,
            "parameters": {k: list(v.shape) for k, v in trainer.net.state_dict().items()},
            "world_size": trainer.world_size,
        },
    }
    for name, value in state.items():
        parts[name] = ("msgpack", _msgpack.encode(value))
    for cb in trainer.callbacks:
        cb_state = cb.state_dict()
        if cb_state is not None:
            parts[f"callback/{cb.name}"] = ("msgpack", _msgpack.encode(cb_state))
    return parts


def _safe_torch_bytes(name: str, value: Any) -> bytes:
    """``torch.save`` bytes of ``value`` that the safe loader reads back (checked now, not at resume).

    Raises:
        ConfigError: the state holds an object ``torch.save`` cannot pickle (a lambda, say) or
            ``torch.load(weights_only=True)`` refuses (a custom class): a checkpoint that
            could never be resumed is not written.
    """
    advice = ("keep state dicts to tensors, NumPy numbers and arrays of native byte order, and plain "
              "Python values (or drop the value before training)")
    try:
        data = torch_bytes(value)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(f"checkpoint component {name!r} holds a value that cannot be saved ({exc}); "
                          f"{advice}") from None
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = [line.strip() for line in str(exc).splitlines() if "Unsupported global" in line]
        why = found[0].split(" was not an allowed global")[0] if found else str(exc).splitlines()[0]
        raise ConfigError(f"checkpoint component {name!r} holds a value no safe loader can read back ({why}); "
                          f"{advice}") from None
    return data


def encode_parts(parts: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, bytes]]:
    """Serialize :func:`capture`'s components: ``torch.save`` bytes for ``"torch"`` ones, each
    checked to load back with ``weights_only=True`` (:func:`_safe_torch_bytes`)."""
    return {name: (codec, _safe_torch_bytes(name, value) if codec == "torch" else value)
            for name, (codec, value) in parts.items()}


def load_state(store: BlobStore, manifest: Manifest) -> dict[str, Any]:
    """Load every component of ``manifest`` safely (raises before anything is applied)."""
    return {name: load_component(store, manifest, name) for name in manifest.components}


def _check_same_generators(trainer: Trainer, rng: dict[str, Any]) -> None:
    """Refuse loaders whose own generators differ from the run's (their states, not seeds, are restored).

    One rule for the train and the validation loader (:func:`nnx_es.rng.generators_mismatch`);
    a checkpoint from before the validation loader's were kept reads as "none".

    Raises:
        ResumeError: a loader has, or lacks, a DataLoader ``generator``, or its samplers have
            another number of generators of their own than the checkpoint holds (named).
    """
    why = generators_mismatch(rng, trainer.generators)
    if why is not None:
        raise ResumeError(f"cannot restore the data order: {why}; "
                          "build it with the same generators (any seed: their states are restored)")


def weight_misfits(net: nn.Module, weights: dict[str, Any]) -> str:
    """How ``weights`` (a model state dict) does not fit ``net``: keys either lacks and shapes
    that differ, the first six named; ``""`` when it fits. Checked before loading, because
    ``load_state_dict`` copies what fits and then raises."""
    own = net.state_dict()
    misfits = [f"{k} only in the checkpoint" for k in sorted(set(weights) - set(own))] + [
        f"{k} only in this net" for k in sorted(set(own) - set(weights))] + [
        f"{k}: {tuple(weights[k].shape)} in the checkpoint, {tuple(v.shape)} here"
        for k, v in own.items() if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    return "; ".join(misfits[:6]) + (f"; and {len(misfits) - 6} more" if len(misfits) > 6 else "")


def apply_state(trainer: Trainer, state: dict[str, Any], *, weights_only: bool = False) -> None:
    """Restore ``trainer`` from :func:`load_state`'s result.

    A stateful restore (not ``weights_only``) first checks that the train and validation
    loaders have the run's generators, then restores every RNG stream last.

    Raises:
        ResumeError: the checkpoint does not match the trainer (a missing
            optimizer, scheduler, callback state, a different model topology, or
            loaders whose own generators differ from the run's).
    """
    # everything that can refuse is checked before anything is applied
    misfits = weight_misfits(trainer.net, state["model"])
    if misfits:
        raise ResumeError(f"the checkpoint's model does not fit this net (another architecture?): {misfits}")
    if not weights_only:
        _check_same_generators(trainer, state["rng"])
        wanted = [("optimizer", f"optimizer/{n}") for n in trainer.optimizers]
        wanted += [("scheduler", f"scheduler/{s.name}") for s in trainer.schedulers]
        wanted += [("callback", f"callback/{cb.name}") for cb in trainer.callbacks if cb.state_dict() is not None]
        for what, key in wanted:
            if key not in state:
                raise ResumeError(f"the checkpoint has no state for {what} {key.split('/', 1)[1]!r}; "
                                  f"it has {sorted(state)}")
    trainer.net.load_state_dict(state["model"])
    if weights_only:
        return
    for n, o in trainer.optimizers.items():
        o.load_state_dict(state[f"optimizer/{n}"])
    for s in trainer.schedulers:
        s.load_state_dict(state[f"scheduler/{s.name}"])
    if trainer.engine.scaler is not None and "scaler" in state:
        trainer.engine.scaler.load_state_dict(state["scaler"])
    for h in trainer.update_hooks:
        if isinstance(h, EMA) and f"update_hook/{h.name}" in state:
            h.load_torch_state(state[f"update_hook/{h.name}"])
    if trainer.monitor is not None and state.get("monitor") is not None:
        trainer.monitor.load_state_dict(state["monitor"])
    for cb in trainer.callbacks:
        key = f"callback/{cb.name}"
        if key in state:
            cb.load_state_dict(state[key])
    restore_rng(state["rng"], trainer.generators)
