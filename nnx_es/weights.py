"""Reading a model's weights out of a run's BEST or LAST checkpoint: one path for every loader.

:meth:`nnx_es.NNModel.load`, :class:`nnx_es.finetune.WeightsFrom` and (through ``load``)
:meth:`nnx_es.decisions.FixedHeadProvider.from_run` all read weights here, so each makes the
same checks in the same order: the run's committed pointer (:func:`nnx_es.result.loadable`:
present, not pruned), the manifest's hash and its run id (another run's manifest is refused, as
``tools/replay`` and a resume refuse it), each component's SHA-256 and the codec's field checks.

A run of several models (``Trainer(net={"student": ..., "teacher": ...})``) stores its trainable
models in one ``model`` component, each model's keys under its name (``student.0.weight``):
``model="student"`` takes that model's keys with the prefix removed, the state its own module
loads. Frozen models are declared by hash, not stored: asking for one names that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from nnx_es.checkpoint import Manifest, load_component, verify_checkpoint
from nnx_es.errors import CheckpointUnavailableError, ConfigError
from nnx_es.result import Pointer, RunResult, load_result, loadable
from nnx_es.storage import BlobStore
from nnx_es.update_hooks import EMA

__all__ = ["WEIGHTS", "CheckpointWeights", "fitting_models", "model_names", "read_topology", "read_weights"]

#: which of a checkpoint's weights to read (see :func:`read_weights`)
WEIGHTS = ("evaluated", "raw", "averaged")


class CheckpointWeights(NamedTuple):
    """The weights read (``state``: a ``state_dict``, tensors on the CPU), the run and its pointer."""

    state: dict[str, Any]
    result: RunResult
    pointer: Pointer


def _averaged_state(store: BlobStore, manifest: Manifest) -> dict[str, Any] | None:
    """The averaged weights a checkpoint holds (its first ``update_hook/<name>`` component that
    is an :class:`~nnx_es.update_hooks.EMA` state: the hook validation evaluated), or None."""
    for name in manifest.components:
        if name.startswith("update_hook/"):
            weights = EMA.module_state(load_component(store, manifest, name))
            if weights is not None:
                return weights
    return None


def model_names(state: dict[str, Any]) -> list[str]:
    """The first component of each key (a several-model run's model names), in key order."""
    return list(dict.fromkeys(str(key).split(".", 1)[0] for key in state))


def fitting_models(state: dict[str, Any], net_keys: Any) -> list[str]:
    """The stored models of a several-model checkpoint whose keys, without their ``"<model>."`` prefix,
    are exactly ``net_keys`` (a net's ``state_dict()`` keys): the ``model=`` a load of ``state`` into
    that net forgot. A one-model checkpoint (keys that fit as stored) gives none."""
    want = set(net_keys)
    return [name for name in model_names(state)
            if {str(k).split(".", 1)[1] for k in state if str(k).startswith(name + ".")} == want]


def read_weights(run_dir: str | Path, which: str | int = "best", weights: str = "evaluated", *,
                 model: str | None = None) -> CheckpointWeights:
    """Read the weights of ``run_dir``'s ``which`` checkpoint (``"best"``, ``"last"`` or the seq of one of its
    committed LASTs, as ``fit(resume_at=)`` names them), verified.

    Args:
        weights: ``"evaluated"``: the ones validation scored (the averaged weights when the run
            had an :class:`~nnx_es.update_hooks.EMA`, else the net's own; spec 004 "Validation");
            ``"raw"``: the net's own (component ``model``); ``"averaged"``: the averaged ones.
        model: in a run of several models, the model whose weights to read (its keys, with the
            ``"<model>."`` prefix removed); None: every key as stored.

    Raises:
        ConfigError: ``which``, ``weights`` or ``model`` is not valid; ``model`` names no model
            the checkpoint stores (the ones it stores are named; a frozen model is not stored).
        CheckpointUnavailableError: the run has no such checkpoint, retention pruned it, or
            ``weights="averaged"`` and it holds no averaged weights.
        CorruptCheckpointError: a manifest or blob does not verify, or the manifest is another run's.
        EventLogError: the run's log cannot be read (damaged: named).
    """
    if which not in ("best", "last") and not (isinstance(which, int) and not isinstance(which, bool)):
        raise ConfigError(f"which must be 'best', 'last' or a LAST's seq (an int), got {which!r}")
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}")
    if model is not None and not (isinstance(model, str) and model.isidentifier()):
        raise ConfigError(f"model must be a model's name (an identifier) or None, got {model!r}")
    result = load_result(run_dir)
    pointer = loadable(result, which) if isinstance(which, str) else _last_at(Path(run_dir), which)
    store = BlobStore(Path(run_dir) / "blobs")  # reads manifests from the run's log, opened read-only
    # the manifest must name this run, as replay and resume check: another run's checkpoint is refused
    manifest = verify_checkpoint(store, pointer.manifest, run_id=result.run_id)
    state = _averaged_state(store, manifest) if weights != "raw" else None
    if state is None and weights == "averaged":
        raise CheckpointUnavailableError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch "
                                         f"{pointer.epoch}) holds no averaged weights: the run had no EMA update "
                                         "hook; load weights='evaluated' or 'raw'")
    state = state if state is not None else load_component(store, manifest, "model")
    if model is not None:
        prefix = model + "."
        picked = {key[len(prefix):]: value for key, value in state.items()
                  if isinstance(key, str) and key.startswith(prefix)}
        if not picked:
            raise ConfigError(f"the {which.upper()} checkpoint of run {result.run_id!r} stores no model {model!r}: "
                              f"it stores {model_names(state)} (a frozen model of a several-model run is declared "
                              "by its hash, not stored; model=None reads every key as stored)")
        state = picked
    return CheckpointWeights(state, result, pointer)


def _last_at(run_dir: Path, seq: int) -> Pointer:
    """The pointer of the committed LAST at ``seq`` (its manifest verified by :func:`~nnx_es.resume.find_resume_point`).

    Raises:
        CheckpointUnavailableError: no committed LAST at ``seq`` (the committed ones named), or it does not verify.
    """
    from events.log import LmdbLog
    from nnx_es.errors import ResumeError
    from nnx_es.resume import find_resume_point

    try:
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
            point = find_resume_point(run_dir, log, at=seq)
    except ResumeError as exc:
        raise CheckpointUnavailableError(str(exc)) from None
    return Pointer(manifest=point.manifest_hash, epoch=point.manifest.epoch, step=point.manifest.counters.step)


def read_topology(run_dir: str | Path, manifest: str, run_id: str) -> dict[str, Any]:
    """The ``topology`` component of the checkpoint ``manifest`` of run ``run_id`` at ``run_dir``, verified:
    the net's structure and the transforms applied to it (:mod:`nnx_es.transforms`); ``{}`` when it has none.

    Raises:
        CorruptCheckpointError: the manifest or the component does not verify or decode.
    """
    store = BlobStore(Path(run_dir) / "blobs")
    checked = verify_checkpoint(store, manifest, run_id=run_id)
    topology = load_component(store, checked, "topology") if "topology" in checked.components else {}
    return topology if isinstance(topology, dict) else {}
