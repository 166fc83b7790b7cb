"""Where a run trains: the device named by ``Trainer(device=...)``, and batches moved there.

:func:`resolve_device` turns ``device`` (``None``: the model's own device; ``"cpu"``,
``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``) into a ``torch.device`` with
its index filled in (``"cuda"`` is the current CUDA device), and refuses, by name and
before anything trains, a string torch does not parse, a device type this machine does
not have, or an index past its device count.

:func:`move_batch` moves every tensor of a batch to that device -- through tuples
(named ones too), lists, mappings and dataclass instances, nested, leaving everything
else as it is -- with ``non_blocking=True`` when the loader pins memory (a copy from
pinned host memory then overlaps the compute queue, as ``DataLoader(pin_memory=True)``
intends). A tensor already there is passed through untouched (no copy, no op).

Checkpoints stay device-independent whatever the device: every tensor is stored as
host bytes (:mod:`nnx_es.state_codec`) and loaded onto the device of what it is loaded
into (``load_state_dict`` copies into the parameters where they are; an optimizer casts
its state to its parameters' device), so a run trained on a GPU resumes on a CPU and the
reverse. The device's own random stream (CUDA's, MPS's) is not part of a checkpoint:
a resume on any device draws it afresh (the CPU streams -- torch, NumPy, Python, the
loaders' generators -- are restored exactly).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from nnx_es.errors import ConfigError

__all__ = ["available_devices", "batch_mover", "model_device", "move_batch", "resolve_device"]


def model_device(net: nn.Module) -> torch.device:
    """The device of ``net``'s first parameter (or buffer); CPU for a module with neither."""
    for t in net.parameters():
        return t.device
    for t in net.buffers():
        return t.device
    return torch.device("cpu")


def available_devices() -> list[str]:
    """The device types this machine can train on, CPU first: ``["cpu", "cuda"?, "mps"?]``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(device: str | torch.device | None, net: nn.Module) -> torch.device:
    """The device a run trains on (see the module docstring).

    Raises:
        ConfigError: ``device`` is not a device torch knows, or not one this machine has
            (the value and the available devices named).
    """
    if device is None:
        return model_device(net)
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise ConfigError(f"device must be None, a string like 'cpu', 'cuda', 'cuda:1', 'mps', or a torch.device; "
                          f"got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a device torch knows ({exc}); use 'cpu', 'cuda', 'cuda:N' or "
                          f"'mps' (available here: {', '.join(available_devices())})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available on this machine "
                              f"(available: {', '.join(available_devices())})")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if "mps" not in available_devices():
            raise ConfigError(f"device {device!r}: MPS is not available on this machine "
                              f"(available: {', '.join(available_devices())})")
        if dev.index not in (None, 0):
            raise ConfigError(f"device {device!r}: MPS has one device, 'mps' (or 'mps:0')")
        return torch.device("mps", 0)
    raise ConfigError(f"device {device!r}: training on {dev.type!r} is not supported; use 'cpu', 'cuda', 'cuda:N' "
                      f"or 'mps' (available here: {', '.join(available_devices())})")


def place_model(net: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], device: torch.device) -> None:
    """Move ``net`` (in place: its parameters keep their identity, so the optimizers still hold
    them) and any state the optimizers already have to ``device``."""
    net.to(device)
    for opt in optimizers.values():
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor) and v.device != device and not (k == "step" and v.dim() == 0):
                    state[k] = v.to(device)


def move_batch(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device`` (see the module docstring); containers are rebuilt
    only when something in them moved."""
    kind = type(batch)
    if kind is tuple or kind is list:  # the usual batch, tensors already there: nothing to rebuild, no call
        for x in batch:
            if not (type(x) is Tensor and x.device == device):
                break
        else:
            return batch
    if isinstance(batch, Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        items = [move_batch(x, device, non_blocking) for x in batch]
        if all(a is b for a, b in zip(items, batch)):
            return batch
        if isinstance(batch, list):
            return items
        if hasattr(batch, "_fields"):  # a named tuple
            return type(batch)(*items)
        return tuple(items) if type(batch) is tuple else type(batch)(items)
    if isinstance(batch, Mapping):
        moved = {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
        if all(moved[k] is v for k, v in batch.items()):
            return batch
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            new = move_batch(value, device, non_blocking)
            if new is not value:
                changes[f.name] = new
        if not changes:
            return batch
        out = copy.copy(batch)
        for name, value in changes.items():
            object.__setattr__(out, name, value)  # a frozen dataclass too
        return out
    return batch


def batch_mover(device: torch.device | None, *, pinned: bool = False) -> Callable[[Any], Any] | None:
    """``batch -> batch on device`` for a loader (``pinned``: it pins memory), or ``None`` when
    ``device`` is ``None`` (batches are used as they come)."""
    if device is None:
        return None
    non_blocking = pinned and device.type != "cpu"
    return lambda batch: move_batch(batch, device, non_blocking)
