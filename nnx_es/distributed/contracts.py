"""Contracts between the trainer and a distributed training backend (spec 003, "training contracts").

Three things, all plain data and none of them importing torch:

* :class:`ParallelPlan` -- the process mesh a run asks for (data-parallel replicate and shard,
  tensor, pipeline, context, expert and expert-tensor parallel degrees) and its batch schedule
  (pipeline microbatches, gradient accumulation steps);
* :class:`BackendCapabilities` -- what a backend really executes, not what it accepts as flags;
  :func:`check_plan` refuses a plan that asks for more, naming the axis;
* a registry of backends by name: :func:`register_training_backend` /
  :func:`get_training_backend`. A backend may be registered as a zero-argument lazy factory,
  called once, on first lookup, so registering (and importing this module) imports no
  optional dependency. The torch DDP backend (``"torch-ddp"``,
  :mod:`nnx_es.distributed.torch_backend`) is registered here that way.

The mesh follows torchtitan's ``ParallelDims``: the orthogonal dimensions are
``pp x dp_replicate x dp_shard x cp x tp``; expert parallelism (``ep``) and expert tensor
parallelism (``etp``) are process groups cut out of those ranks, not further dimensions, so
they never change ``world_size``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from nnx_es.errors import ConfigError, NnxError

__all__ = [
    "AXES",
    "MESH_AXES",
    "BackendCapabilities",
    "BackendRegistrationError",
    "DistributedTrainingBackend",
    "ParallelPlan",
    "PlanRefusedError",
    "UnknownBackendError",
    "check_plan",
    "get_training_backend",
    "register_training_backend",
    "registered_backends",
]

#: the orthogonal dimensions of the device mesh, outermost first (torchtitan's order)
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: every parallel axis a plan can name: the mesh's, then the overlapping expert groups
AXES: tuple[str, ...] = (*MESH_AXES, "ep", "etp")
_DP_AXES = ("dp_replicate", "dp_shard")
_PRECISIONS = frozenset({"fp32", "bf16", "fp16"})


class PlanRefusedError(ConfigError):
    """A backend does not execute what a :class:`ParallelPlan` asks for (the axis is named)."""


class UnknownBackendError(NnxError, KeyError):
    """No training backend is registered under the name asked for (the registered ones are listed)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendRegistrationError(NnxError, ValueError):
    """A backend name is already registered (without ``override=True``), or what was registered
    is neither a backend nor a zero-argument factory of one."""


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ParallelPlan:
    """An explicit N-D process mesh and batch schedule (spec 003, ``ParallelPlan``).

    Args (each a positive int, 1 = that axis is not used):
        dp_replicate: data-parallel replicas (plain DDP; the replicate half of HSDP).
        dp_shard: data-parallel shards (FSDP / ZeRO; the shard half of HSDP).
        tp / pp / cp: tensor, pipeline and context (sequence) parallel degrees.
        ep: expert-parallel degree; its groups are cut from ``dp_shard x cp`` (x ``tp`` when
            ``etp == 1``), so it must divide that product.
        etp: expert tensor-parallel degree: 1, or equal to ``tp``.
        microbatches: pipeline microbatches per step.
        gradient_accumulation_steps: microbatches accumulated into one optimizer update per rank.

    Raises:
        ConfigError: a field that is not a positive int (the field and value are named), or an
            ``ep`` / ``etp`` the mesh cannot hold.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    microbatches: int = 1
    gradient_accumulation_steps: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive_int("ParallelPlan", f.name, getattr(self, f.name))
        if self.etp not in (1, self.tp):
            raise ConfigError(f"ParallelPlan.etp must be 1 or equal to tp={self.tp}, got {self.etp!r}")
        if self.ep > 1:
            pool = self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
            where = "dp_shard x cp" + (" x tp" if self.etp == 1 else "")
            if pool % self.ep:
                raise ConfigError(
                    f"ParallelPlan.ep={self.ep} must divide {where} = {pool}: expert groups are cut from "
                    "those ranks, not added to the mesh"
                )

    @property
    def world_size(self) -> int:
        """Number of physical ranks: ``pp x dp_replicate x dp_shard x cp x tp`` (ep / etp overlap them)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(names, shape)`` for ``torch.distributed.init_device_mesh``: the axes of :data:`MESH_AXES`
        larger than 1, in that order, and always a data-parallel dimension (``dp_replicate`` of 1
        when neither data-parallel axis is used), so code slicing ``mesh["dp_..."]`` finds one.
        The product of ``shape`` is :attr:`world_size`."""
        names = [a for a in MESH_AXES if getattr(self, a) > 1 or (
            a == "dp_replicate" and self.dp_replicate == 1 and self.dp_shard == 1)]
        return tuple(names), tuple(getattr(self, a) for a in names)

    @property
    def active_axes(self) -> tuple[str, ...]:
        """The axes of :data:`AXES` this plan uses (degree > 1), in that order."""
        return tuple(a for a in AXES if getattr(self, a) > 1)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend actually executes, rather than merely accepts as flags (spec 003).

    Args:
        name: the backend's registry name.
        axes: the axes of :data:`AXES` it executes with a degree > 1 (every axis may be 1).
        precisions: the update precisions it runs (``"fp32"``, ``"bf16"``, ``"fp16"``).
        distributed_optimizer: optimizer state is sharded across ranks (ZeRO-1 and up).
        reshardable_checkpoint: a checkpoint can be resumed on another world size or plan.
        elastic_restart: a restarted process group (``torchrun --max-restarts``) continues the run.
        requirements: what must hold for it to run, in words (libraries, launcher, devices).
        incompatible_axis_sets: sets of axes it executes alone but not together.

    Raises:
        ConfigError: an axis or precision it does not know, or an empty name.
    """

    name: str
    axes: frozenset[str]
    precisions: frozenset[str] = frozenset({"bf16", "fp32"})
    distributed_optimizer: bool = False
    reshardable_checkpoint: bool = False
    elastic_restart: bool = False
    requirements: tuple[str, ...] = ()
    incompatible_axis_sets: tuple[frozenset[str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"BackendCapabilities.name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "axes", frozenset(self.axes))
        object.__setattr__(self, "precisions", frozenset(self.precisions))
        object.__setattr__(self, "requirements", tuple(self.requirements))
        object.__setattr__(self, "incompatible_axis_sets", tuple(frozenset(s) for s in self.incompatible_axis_sets))
        unknown = sorted(self.axes.union(*self.incompatible_axis_sets) - set(AXES))
        if unknown:
            raise ConfigError(f"BackendCapabilities({self.name!r}) names unknown axes {unknown}; known: {list(AXES)}")
        bad = sorted(self.precisions - _PRECISIONS)
        if bad:
            raise ConfigError(
                f"BackendCapabilities({self.name!r}) names unknown precisions {bad}; known: {sorted(_PRECISIONS)}"
            )


@runtime_checkable
class DistributedTrainingBackend(Protocol):
    """What the registry hands out: an object that declares its :class:`BackendCapabilities`."""

    @property
    def capabilities(self) -> BackendCapabilities: ...


def check_plan(plan: ParallelPlan, capabilities: BackendCapabilities, *, precision: str | None = None) -> None:
    """Refuse ``plan`` (and ``precision``, when given) unless ``capabilities`` executes all of it.

    Raises:
        PlanRefusedError: an axis of degree > 1 the backend does not execute (the first such
            axis in :data:`AXES` order is named, with its degree and what the backend executes),
            a combination of axes it declares incompatible, or a precision it does not run.
    """
    for axis in plan.active_axes:
        if axis not in capabilities.axes:
            runs = ", ".join(a for a in AXES if a in capabilities.axes) or "no parallel axis"
            raise PlanRefusedError(
                f"backend {capabilities.name!r} does not execute axis {axis!r} (the plan asks for "
                f"{axis}={getattr(plan, axis)}); it executes: {runs}. Set {axis}=1 or choose another backend"
            )
    active = set(plan.active_axes)
    for combo in capabilities.incompatible_axis_sets:
        if combo and combo <= active:
            raise PlanRefusedError(
                f"backend {capabilities.name!r} does not execute axes {sorted(combo)} together "
                f"(the plan asks for {', '.join(f'{a}={getattr(plan, a)}' for a in sorted(combo))})"
            )
    if precision is not None and precision not in capabilities.precisions:
        raise PlanRefusedError(
            f"backend {capabilities.name!r} does not run precision {precision!r}; it runs: "
            f"{sorted(capabilities.precisions)}"
        )


# --- the registry -------------------------------------------------------------------------------

_lock = threading.RLock()  # re-entrant: a factory may look up or register other backends
#: name -> ("backend", obj) | ("factory", zero-argument callable)
_registry: dict[str, tuple[str, Any]] = {}


def _is_backend(obj: Any) -> bool:
    return isinstance(getattr(obj, "capabilities", None), BackendCapabilities)


def register_training_backend(
    name: str, backend_or_lazy_factory: Any | Callable[[], Any], *, override: bool = False
) -> None:
    """Register a backend under ``name``, or a zero-argument factory that builds it on first lookup.

    A backend is any object whose ``capabilities`` is a :class:`BackendCapabilities`; anything
    else must be a zero-argument callable returning one (called once, by
    :func:`get_training_backend`, never here -- so registering imports nothing).

    Raises:
        BackendRegistrationError: ``name`` is already registered and ``override`` is False, ``name``
            is not a non-empty str, or the object is neither a backend nor callable.
    """
    if not isinstance(name, str) or not name:
        raise BackendRegistrationError(f"a training backend's name must be a non-empty str, got {name!r}")
    if _is_backend(backend_or_lazy_factory):
        entry = ("backend", backend_or_lazy_factory)
    elif callable(backend_or_lazy_factory):
        entry = ("factory", backend_or_lazy_factory)
    else:
        raise BackendRegistrationError(
            f"register_training_backend({name!r}, ...) takes a backend (an object with BackendCapabilities "
            f"as .capabilities) or a zero-argument factory of one, got {backend_or_lazy_factory!r}"
        )
    with _lock:
        if name in _registry and not override:
            raise BackendRegistrationError(
                f"a training backend named {name!r} is already registered; pass override=True to replace it"
            )
        _registry[name] = entry


def get_training_backend(name: str) -> Any:
    """The backend registered under ``name``; a lazy factory is called once (thread-safe) and its
    result kept.

    Raises:
        UnknownBackendError: nothing is registered under ``name`` (the registered names are listed).
        BackendRegistrationError: the factory returned something without ``BackendCapabilities``
            (nothing is kept; the next lookup calls it again). Whatever the factory raises
            propagates, and nothing is kept either.
    """
    with _lock:
        entry = _registry.get(name)
        if entry is None:
            raise UnknownBackendError(
                f"no training backend named {name!r}; registered: {sorted(_registry)}"
            )
        kind, obj = entry
        if kind == "backend":
            return obj
        backend = obj()
        if not _is_backend(backend):
            raise BackendRegistrationError(
                f"the factory registered as training backend {name!r} returned {backend!r}, which has no "
                "BackendCapabilities as .capabilities"
            )
        if _registry.get(name) is entry:  # the factory did not re-register the name meanwhile
            _registry[name] = ("backend", backend)
        return backend


def registered_backends() -> tuple[str, ...]:
    """The registered names, sorted (lazy factories included, none of them called)."""
    with _lock:
        return tuple(sorted(_registry))


def _torch_ddp() -> Any:
    import importlib

    # by its module's name: the backend is looked up lazily, on first use, and this module imports none of it
    return importlib.import_module("nnx_es.distributed.torch_backend").TorchDDPBackend()


register_training_backend("torch-ddp", _torch_ddp)
