"""A trainer's restart-critical state as checkpoint components, and back.

:class:`RunComponents` names the objects whose state a checkpoint holds (the trainer
builds it once); :func:`capture` builds the components of one checkpoint from them;
:func:`load_state` reads every component of a verified manifest with the safe
loaders (nothing is applied until all of them loaded); :func:`apply_state`
puts them back. Components (see :mod:`nnx_es.checkpoint`)::

    model, optimizer/<name>, scheduler/<name>, scaler, update_hook/<name>   tensors (or torch)
    schedulers, monitor, rng, data, topology, callback/<name>               msgpack
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import Tensor, nn

from nnx_es.checkpoint import Manifest, load_component, torch_bytes
from nnx_es.distributed.resize import (elastic_topology, global_batch_sampler, refuse_elastic_checkpoint,
                                       resume_streams)
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.rng import LoaderGenerators, capture_rng, generators_mismatch, restore_rng
from nnx_es.runtime.run_state import World
from nnx_es.state_codec import encode_state
from nnx_es.storage import BlobStore
from nnx_es.transforms.core import apply_pending, pending, probe, recorded
from nnx_es.update_hooks import EMA, UpdateHook

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from nnx_es.callbacks import Callback
    from nnx_es.runtime.engine import UpdateEngine
    from nnx_es.monitor import Monitor
    from nnx_es.schedulers import Scheduler

__all__ = ["RunComponents", "apply_state", "capture", "check_world_size", "detached_copy", "encode_parts", "load_state",
           "load_weights", "weight_misfits"]


class RunComponents:
    """The objects whose state a checkpoint holds and a resume restores.

    ``loaders``: the train and validation loaders of one ``fit`` (``{"train": ..., "val": ...}``,
    ``None`` when absent; their geometry goes in ``run_started``); ``generators``: their own
    generators (:meth:`~nnx_es.rng.LoaderGenerators.of` each, by default). ``world``: the process
    group of the fit (data parallelism: every rank's RNG streams are gathered into each checkpoint,
    and each rank restores its own). The GradScaler is read from ``engine`` when a checkpoint is
    captured (it may be replaced before training).
    """

    def __init__(self, *, net: nn.Module, optimizers: Mapping[str, Optimizer], schedulers: Sequence[Scheduler],
                 engine: UpdateEngine, update_hooks: Sequence[UpdateHook], monitor: Monitor | None,
                 callbacks: Sequence[Callback], loaders: dict[str, Any] | None = None,
                 generators: dict[str, LoaderGenerators] | None = None, world: World | None = None) -> None:
        self.net = net
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.engine = engine
        self.averages = [h for h in update_hooks if isinstance(h, EMA)]
        self.monitor = monitor
        self.callbacks = callbacks
        self.loaders: dict[str, Any] = dict(loaders or {})
        self.generators: dict[str, LoaderGenerators] = generators if generators is not None else {
            role: LoaderGenerators.of(loader) for role, loader in self.loaders.items()}
        self.world: World = world or World()
        #: events a restore asks the run to record after its opening (an elastic run's ``world_changed``)
        self.notes: list[Any] = []

    @property
    def resizable(self) -> bool:
        """Elastic mode: the train loader deals a declared global batch (``nnx_es.distributed.elastic_loader``),
        so a full-state resume may run on another world size (:mod:`nnx_es.distributed.resize`)."""
        return global_batch_sampler(self.loaders.get("train")) is not None

    def take_notes(self) -> list[Any]:
        """The events the latest restore asked for (see :attr:`notes`), once: the list is emptied."""
        notes, self.notes = self.notes, []
        return notes

    def partitions(self) -> dict[str, Any]:
        """How the loaders deal the rows to the ranks (``describe()`` of a partition sampler), by role."""
        out: dict[str, Any] = {}
        for role, loader in self.loaders.items():
            describe = getattr(getattr(loader, "sampler", None), "describe", None)
            if callable(describe):
                out[role] = describe()
        return out

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


def capture(run: RunComponents, epoch: int, world_size: int = 1) -> dict[str, tuple[str, Any]]:
    """Components of a checkpoint holding ``run`` after 0-based ``epoch`` (-1: before training).

    Cheap, on the training thread: state dicts are encoded with the ``"tensors"`` codec
    (:mod:`nnx_es.state_codec`: raw tensor bytes, microseconds for a small model), or kept
    as detached copies for ``torch.save`` by :func:`encode_parts` (off the training thread
    when the commit is deferred) when that codec cannot hold them; ``"msgpack"``
    components are encoded here.
    """
    weights = run.net.state_dict()
    parts: dict[str, tuple[str, Any]] = {"model": _state_part(weights)}
    for n, o in run.optimizers.items():
        parts[f"optimizer/{n}"] = _state_part(o.state_dict())
    for s in run.schedulers:
        parts[f"scheduler/{s.name}"] = _state_part(s.state_dict())
    if run.engine.scaler is not None:
        parts["scaler"] = _state_part(run.engine.scaler.state_dict())
    for h in run.averages:
        parts[f"update_hook/{h.name}"] = _state_part(h.torch_state())
    rng = capture_rng(run.generators)
    state = {
        "schedulers": {s.name: s.summary() for s in run.schedulers},
        "monitor": run.monitor.state_dict() if run.monitor else None,
        "rng": rng,
        "data": {"next_epoch": epoch + 1},
        "topology": {
            "module": type(run.net).__qualname__,
            "parameters": {k: list(v.shape) for k, v in weights.items() if isinstance(v, Tensor)},
            "world_size": world_size,
        },
    }
    transforms = recorded(run.net)
    if transforms:  # the transforms applied to the net, rebuilt on a fresh net by a resume or a load
        state["topology"]["transforms"] = transforms
    elastic = elastic_topology(run.loaders)
    if elastic is not None:  # an elastic run's deal (only then: other checkpoints keep their bytes)
        state["topology"]["elastic"] = elastic
    world = run.world
    if world.distributed:
        # every rank's RNG streams (global and its loaders' own), gathered on every rank: the writer's
        # checkpoint holds them all, and every rank captures the same bytes ("rng" is the writer's)
        ranks = world.gather(rng)
        state["rng"] = ranks[world.writer_rank]
        state["ranks"] = {"rng": ranks, "partitions": run.partitions()}
        state["topology"]["partitions"] = run.partitions()
    for name, value in state.items():
        parts[name] = ("msgpack", _msgpack.encode(value))
    for cb in run.callbacks:
        cb_state = cb.state_dict()
        if cb_state is not None:
            parts[f"callback/{cb.name}"] = ("msgpack", _callback_state(cb.name, cb_state))
    return parts


def _callback_state(name: str, state: Any) -> bytes:
    """A callback's ``state_dict()`` as msgpack.

    Raises:
        ConfigError: naming the callback and the first key whose value msgpack cannot hold.
    """
    try:
        return _msgpack.encode(state)
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        where = "its value"
        if isinstance(state, dict):
            for key, value in state.items():
                try:
                    _msgpack.encode({key: value})
                except (TypeError, OverflowError, msgspec.EncodeError):
                    where = f"state_dict()[{key!r}] ({type(value).__name__})"
                    break
        raise ConfigError(
            f"callback {name!r}: {where} cannot be checkpointed ({exc}); a callback's state_dict() holds "
            "msgpack-able builtins (str keys; str, numbers, bools, None, lists, dicts): convert tensors with "
            ".tolist() and objects to their fields"
        ) from None


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


def _check_same_generators(run: RunComponents, rng: dict[str, Any]) -> None:
    """Refuse loaders whose own generators differ from the run's (their states, not seeds, are restored).

    One rule for the train and the validation loader (:func:`nnx_es.rng.generators_mismatch`);
    a checkpoint from before the validation loader's were kept reads as "none".

    Raises:
        ResumeError: a loader has, or lacks, a DataLoader ``generator``, or its samplers have
            another number of generators of their own than the checkpoint holds (named).
    """
    why = generators_mismatch(rng, run.generators)
    if why is not None:
        raise ResumeError(f"cannot restore the data order: {why}; "
                          "build it with the same generators (any seed: their states are restored)")


def weight_misfits(net: nn.Module, weights: Any) -> str:
    """How ``weights`` (a model state dict) does not fit ``net``: keys either lacks, values that are not
    tensors and shapes that differ, the first six named; ``""`` when it fits. Checked before loading,
    because ``load_state_dict`` copies what fits and then raises; ``weights`` is a checkpoint's
    component, someone else's bytes: anything but a dict of tensors is named, never an error."""
    if not isinstance(weights, dict):
        return f"the checkpoint's weights are a {type(weights).__name__}, not a state dict"
    own = net.state_dict()
    misfits = [f"{k} only in the checkpoint" for k in sorted(set(weights) - set(own), key=repr)] + [
        f"{k} only in this net" for k in sorted(set(own) - set(weights))] + [
        f"{k}: a {type(weights[k]).__name__} in the checkpoint, not a {_kind(v)}"
        for k, v in own.items() if k in weights and not _same_kind(weights[k], v)] + [
        f"{k}: {tuple(weights[k].shape)} in the checkpoint, {tuple(v.shape)} here"
        for k, v in own.items()
        if isinstance(weights.get(k), torch.Tensor) and tuple(weights[k].shape) != tuple(v.shape)
    ]
    return "; ".join(misfits[:6]) + (f"; and {len(misfits) - 6} more" if len(misfits) > 6 else "")


def load_weights(net: nn.Module, weights: dict[str, Any]) -> None:
    """``net.load_state_dict(weights)``, with the module versions of ``net``'s own state dict when ``weights``
    carries none (a checkpoint keeps the values, not the ``_metadata`` torch attaches to a state dict; a
    dynamically quantized layer reads a state without its version as an older layout and fails)."""
    if getattr(weights, "_metadata", None) is None:
        metadata = getattr(net.state_dict(), "_metadata", None)
        if metadata is not None:
            weights = collections.OrderedDict(weights)
            weights._metadata = metadata  # type: ignore[attr-defined]
    net.load_state_dict(weights)


def _kind(value: Any) -> str:
    return "tensor" if isinstance(value, Tensor) else type(value).__name__


def _same_kind(theirs: Any, own: Any) -> bool:
    """A checkpoint's value where the net holds ``own``: a tensor for a tensor; for the few other values a
    state dict holds (a dynamically quantized layer's packed weights, a tuple of tensors, and its dtype), the
    same type, a tuple's items alike."""
    if isinstance(own, Tensor):
        return isinstance(theirs, Tensor)
    if isinstance(own, tuple):
        return isinstance(theirs, tuple) and len(theirs) == len(own) and all(map(_same_kind, theirs, own))
    return type(theirs) is type(own)


def apply_state(run: RunComponents, state: dict[str, Any], *, weights_only: bool = False) -> None:
    """Restore ``run`` from :func:`load_state`'s result.

    A stateful restore (not ``weights_only``) first checks that the train and validation
    loaders have the run's generators, then restores every RNG stream last.

    Raises:
        ResumeError: the checkpoint does not match the trainer (a missing
            optimizer, scheduler, callback state, a different model topology, or
            loaders whose own generators differ from the run's), or the checkpoint's net was transformed
            otherwise than this one and the difference cannot be rebuilt under the optimizers
            (:func:`nnx_es.transforms.core.pending`: a transform that changes parameters, undeclared).
        CorruptCheckpointError: a recorded transform cannot be rebuilt (named).
    """
    # everything that can refuse is checked before anything is applied; the transforms the checkpoint's net
    # carried and this one does not yet are rebuilt on it last, once nothing refuses (nnx_es.transforms)
    try:
        todo = pending(run.net, state.get("topology"), where="the checkpoint", training=True)
    except ConfigError as exc:
        raise ResumeError(f"{exc}; nothing was restored") from None
    misfits = weight_misfits(probe(run.net, todo), state["model"])
    if misfits:
        raise ResumeError(f"the checkpoint's model does not fit this net (another architecture?): {misfits}")
    rng = state.get("rng")
    run.notes = []
    if not weights_only:
        rng = _rank_rng(run, state)
        _check_same_generators(run, rng)
        wanted = [("optimizer", f"optimizer/{n}") for n in run.optimizers]
        wanted += [("scheduler", f"scheduler/{s.name}") for s in run.schedulers]
        wanted += [("callback", f"callback/{cb.name}") for cb in run.callbacks if cb.state_dict() is not None]
        for what, key in wanted:
            if key not in state:
                raise ResumeError(f"the checkpoint has no state for {what} {key.split('/', 1)[1]!r}; "
                                  f"it has {sorted(state)}")
    apply_pending(run.net, todo)
    load_weights(run.net, state["model"])
    if weights_only:
        return
    for n, o in run.optimizers.items():
        o.load_state_dict(state[f"optimizer/{n}"])
    for s in run.schedulers:
        s.load_state_dict(state[f"scheduler/{s.name}"])
    if run.engine.scaler is not None and "scaler" in state:
        run.engine.scaler.load_state_dict(state["scaler"])
    for h in run.averages:
        if f"update_hook/{h.name}" in state:
            h.load_torch_state(state[f"update_hook/{h.name}"])
    if run.monitor is not None and state.get("monitor") is not None:
        run.monitor.load_state_dict(state["monitor"])
    for cb in run.callbacks:
        key = f"callback/{cb.name}"
        if key in state:
            cb.load_state_dict(state[key])
    restore_rng(rng, run.generators)


def _rank_rng(run: RunComponents, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's RNG streams in a checkpoint, after checking that the checkpoint was trained on the
    same world size and partitions (spec 000 §3 "One writer": any other full-state resume is refused)
    -- or, in elastic mode, by :func:`nnx_es.distributed.resize.resume_streams` (any world size dividing
    the run's global batch; the checkpoint of an elastic run is refused to any other loader).

    Raises:
        ResumeError: another world size (a distributed checkpoint resumed by one process included),
            or loaders that partition the rows otherwise; ``resume_mode="weights_only"`` is the way out.
    """
    if run.resizable:  # elastic mode: any world size dividing the global batch (nnx_es.distributed.resize)
        return resume_streams(run, state)
    topology = state.get("topology") or {}
    check_world_size(int(topology.get("world_size", 1) or 1), run.world.size)
    refuse_elastic_checkpoint(topology)
    ours = run.world.size
    if ours == 1:
        return state["rng"]  # type: ignore[no-any-return]
    ranks = state.get("ranks") or {}
    recorded, current = ranks.get("partitions", {}), run.partitions()
    if recorded != current:
        raise ResumeError(f"the checkpoint's data partitions {recorded} differ from this run's {current}: a resume "
                          "must deal the same rows to the same ranks (same policy, seed and data set size); use "
                          "resume_mode='weights_only' to start a new run from its weights; nothing was restored")
    return ranks["rng"][run.world.rank]  # type: ignore[no-any-return]


def check_world_size(theirs: int, ours: int, *, resizable: bool = False) -> None:
    """Refuse a full-state restore of a checkpoint trained on ``theirs`` ranks into ``ours``, unless
    the run is ``resizable`` (elastic mode: its checks come with the checkpoint's state,
    :func:`nnx_es.distributed.resize.resume_streams`).

    Raises:
        ResumeError: the sizes differ (named, with the way out: the same size, or ``weights_only``).
    """
    if theirs != ours and not resizable:
        raise ResumeError(
            f"the checkpoint was trained on {theirs} rank(s) and this run has {ours}: its RNG streams and data "
            f"partitions are per rank, so a full-state resume needs the same world size (start it with "
            f"--nproc_per_node/--nnodes giving {theirs} ranks), or use resume_mode='weights_only' to start a new run "
            "from its weights; nothing was restored")
