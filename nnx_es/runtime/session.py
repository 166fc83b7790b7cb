"""Opening a run for writing: a new run, a stateful resume, or a weights-only continuation.

The writer lease is held for the whole session; stale temporaries a hard kill
left are cleaned and reported; a stateful resume verifies its LAST before
anything is restored (:mod:`nnx_es.resume`) and records the discarded tail.
An opening refused before the session begins (a bad source, another recipe)
removes the run directory it created itself, so a retry is not blocked by an
empty log; a run directory that existed before is never touched.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from events.log import LmdbLog
from events.schema import RunResumed, RunStarted, SourceRef
from events.specs import spec_differences
from nnx_es.checkpoint import Manifest
from nnx_es.distributed.verdict import describe_error, raise_described
from nnx_es.errors import ConfigError, ResumeError, RunExistsError
from nnx_es.injection import ENV_VAR, install_from_environment, kills_expected
from nnx_es.lifecycle import Lifecycle
from nnx_es.loaders import check_same_loaders
from nnx_es.runtime.recording import Recorder
from nnx_es.resume import find_resume_point
from nnx_es.rng import seed_everything
from nnx_es.runtime.run_state import RunState, World
from nnx_es.runtime.components import RunComponents, apply_state, check_world_size, load_state
from nnx_es.storage import BlobStore, Lease, check_run_dir, clean_stale_temporaries, fsync_dir, validate_run_id
from projections.checkpoints import CheckpointsState

__all__ = ["Session", "apply_loaded", "check_epochs", "library_versions", "new_run_id", "open_session"]


#: builds the run's ``run_started`` declaration: ``declare(run_id, source)``
Declare = Callable[[str, "SourceRef | None"], RunStarted]


@dataclass
class Session:
    """An open run: its state, the event that opens this session, the first epoch to train,
    and the run's checkpoints projection so far (a resume's; empty for a new run)."""

    state: RunState
    opening: RunStarted | RunResumed
    start_epoch: int
    checkpoints: CheckpointsState

log = structlog.get_logger("nnx_es")


def new_run_id() -> str:
    """A fresh run id: a timestamp and a random suffix."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_epochs(epochs: int, start_epoch: int) -> None:
    """Refuse a resume asked to train to fewer epochs than its run already committed (before it restores anything).

    Raises:
        ConfigError: ``epochs`` (counted from the run's start) is below the run's committed epochs.
    """
    if epochs < start_epoch:
        raise ConfigError(f"epochs={epochs} is fewer than the {start_epoch} epochs the run already committed: "
                          f"epochs counts from the run's start (pass epochs >= {start_epoch}); nothing was restored or written")


def library_versions() -> dict[str, str]:
    """The versions of nnx_es and the libraries a run depends on (recorded in its opening event)."""
    import lmdb
    import transitions

    import nnx_es

    return {
        "nnx_es": getattr(nnx_es, "__version__", "0"),
        "torch": str(torch.__version__),
        "msgspec": msgspec.__version__,
        "lmdb": lmdb.__version__,
        "transitions": transitions.__version__,
    }



@contextmanager
def open_session(
    *,
    runs_root: Path,
    run_id: str | None,
    seed: int,
    resume_from: str | Path | None,
    resume_mode: str,
    epochs: int,
    components: RunComponents,
    auto: bool = False,
    declare: Declare,
    world: World | None = None,
    resume_at: int | str | None = None,
) -> Iterator[Session]:
    """Hold the lease and the open log of a run; yield its :class:`Session`.

    ``epochs``: the ``fit`` call's, counted from the run's start (a resume to fewer than the
    run committed is refused before anything is restored). ``components``: restored from
    the resume point (all of it, or the weights alone). ``declare``: builds ``run_started``
    (a stateful resume compares the run's with it).

    A stateful resume continues ``resume_from`` (its runs root and id); otherwise the run is
    ``runs_root / run_id`` (a timestamped id when ``None``). ``auto`` (``fit(resume="auto")``):
    ``runs_root / run_id`` is resumed statefully when its log holds a committed LAST; otherwise
    what is there (a log without a LAST, blobs, views) is removed and the run starts afresh. After the session the state's
    store reads through its own log handles (the session's log is closed).

    Nothing under the run is followed (DESIGN.md "Trust boundaries"): ``runs_root / run_id`` must
    be a directory, not a link (a ``resume_from`` the caller names is resolved first: its links
    are the caller's own naming); its log, blobs and views too (:func:`~nnx_es.storage.check_run_dir`).

    Raises:
        ConfigError / ResumeError / LeaseHeldError: see :meth:`nnx_es.Trainer.fit`.
        UnsafePathError: the run directory, its lease file, log, blob or view directory is a
            symbolic link or of the wrong kind; nothing was read or written under it.
    """
    world = world or World()  # resume_mode is one of RESUME_MODES: checked before (argchecks.check_fit_args)
    if not world.is_writer:
        yield _follow(world, runs_root=runs_root, run_id=run_id, resume_from=resume_from, seed=seed,
                      components=components)
        return
    try:
        stateful, resume_from, runs_root, run_id = _target(runs_root, run_id, resume_from, resume_mode, resume_at)
    except BaseException as exc:
        if world.distributed:  # the same refusal on every rank
            world.share({"ok": False, "error": describe_error(exc)})
        raise
    run_dir = runs_root / run_id
    lease = Lease(runs_root, run_id)
    began = created = False
    state: RunState | None = None
    try:
        lease.acquire()
        # under the lease, the run directory is made (never through a link) and locked by its
        # identity: a writer reaching it by another path is refused from here on
        created = lease.hold_run_dir(create=True)
        check_run_dir(run_dir)  # its log, blobs and views: no link, before anything is read, cleared or written
        has_log = (run_dir / "events.lmdb" / "data.mdb").exists()
        if auto and has_log:
            if _has_last(run_dir):
                stateful = True
            else:
                for part in ("events.lmdb", "blobs", "views"):
                    shutil.rmtree(run_dir / part, ignore_errors=True)
                log.warning("resume='auto': the run had no committed LAST; cleared it to start afresh",
                            run_id=run_id, run_dir=str(run_dir))
                has_log = False
        if stateful and not has_log:
            raise ResumeError(f"cannot resume {run_dir}: it has no event log")
        if not stateful and has_log:
            raise RunExistsError(
                f"run {run_id!r} already has an event log at {run_dir}; a new run, a fork or a weights_only "
                f"continuation writes its own run: continue this one with fit(..., resume_from="
                f"{str(run_dir)!r}) or fit(..., resume='auto'), choose another run_id, or delete "
                f"{str(run_dir)!r} to start it over (a run has nothing to resume until its first LAST commit; "
                "resume='auto' clears such a run and starts it afresh)", str(run_dir)
            )
        removed = clean_stale_temporaries(run_dir)
        if removed:  # a crash harness's resumes remove what its kills left, by design: not a warning there
            (log.debug if kills_expected() else log.warning)("removed stale temporaries", run_id=run_id,
                                                             files=[str(p) for p in removed])
        with LmdbLog(run_dir / "events.lmdb") as event_log:
            if not has_log:  # a new log: its directory entries (data.mdb, events.lmdb, the run's) are
                for d in (run_dir / "events.lmdb", run_dir, runs_root):  # durable before a commit relies on
                    fsync_dir(d)  # them; LMDB syncs data.mdb's bytes, never a directory (power loss)
            store = BlobStore(run_dir / "blobs", log=event_log)  # manifests go to the log with LAST
            checkpoints = CheckpointsState()
            if stateful:
                point = find_resume_point(run_dir, event_log, expect_run_id=run_id)
                check_world_size(point.manifest.world_size, components.world.size,  # before the recipe's details
                                 resizable=components.resizable)  # elastic mode: nnx_es.distributed.resize
                declared = declare(run_id, None)
                _check_same_recipe(components, declared, point.started, point.manifest)
                check_epochs(epochs, point.manifest.epoch + 1)
                # then the checkpoint's RNG streams (this rank's own) are restored over it
                seed_everything(seed, rank=world.rank, world_size=world.size)
                shared_state = load_state(store, point.manifest)
                apply_state(components, shared_state)
                recorder = Recorder(event_log, Lifecycle(point.state), counters=point.manifest.counters,
                                    snapshot_start=point.snapshot)
                state = RunState(run_id=run_id, runs_root=runs_root, recorder=recorder, store=store, world=world)
                verdict = {"stateful": True, "state": shared_state, "lifecycle": point.state,
                           "counters": point.manifest.counters, "stop": point.projections.status.stop_reason,
                           "checkpoints": point.projections.checkpoints}
                stop = point.projections.status.stop_reason
                if stop is not None and stop != "update_boundary":
                    # the run had decided to stop (early stopping): resuming finishes it, trains nothing more
                    state.request_stop(stop, "resume")
                checkpoints = point.projections.checkpoints
                opening: RunStarted | RunResumed = RunResumed(
                    last_seq=point.last_seq, manifest=point.manifest_hash, epoch=point.manifest.epoch,
                    discard_from=point.discard_from, discard_to=point.discard_to,
                    library_versions=library_versions(), callbacks=[cb.name for cb in components.callbacks],
                    cleaned_temporaries=len(removed), wall_time_s=time.time(), digests=declared.digests,
                )
                start_epoch = point.manifest.epoch + 1
            else:
                seed_everything(seed, rank=world.rank, world_size=world.size)
                src = loaded = None
                if resume_from is not None:
                    src, loaded = _load_from(components, resume_from, own=run_dir, at=resume_at,
                                             fork=resume_mode == "fork", declared=declare(run_id, None))
                state = RunState(run_id=run_id, runs_root=runs_root, recorder=Recorder(event_log), store=store,
                                 world=world)
                opening = declare(run_id, src)
                start_epoch = 0
                verdict = {"stateful": False, "loaded": loaded, "fork": resume_mode == "fork"}
            if world.distributed:  # the writer's verdict, and what it restored, for every other rank
                world.share({"ok": True, "run_id": run_id, "runs_root": str(runs_root), "opening": opening,
                             "start_epoch": start_epoch, "next_seq": event_log.next_seq, **verdict})
            began = True
            yield Session(state=state, opening=opening, start_epoch=start_epoch, checkpoints=checkpoints)
    except BaseException as exc:
        if not began and created:  # refused before the run began: no empty run to block a retry
            shutil.rmtree(run_dir, ignore_errors=True)
        if not began and world.distributed:  # the same refusal on every rank
            world.share({"ok": False, "error": describe_error(exc)})
        raise
    finally:
        if state is not None:
            state.store = BlobStore(run_dir / "blobs")  # the session's log is closed: later reads open their own
        lease.release()


def _target(runs_root: Path, run_id: str | None, resume_from: str | Path | None, resume_mode: str,
            resume_at: int | str | None) -> tuple[bool, Path | None, Path, str]:
    """Which run a session opens: (stateful, the resolved source, runs root, run id); refuses a bad pairing."""
    stateful = resume_from is not None and resume_mode == "stateful"
    if resume_at is not None and (resume_from is None or stateful):  # an older LAST forks a new run
        raise ConfigError(f"resume_at={resume_at!r} starts a new run from that checkpoint: use resume_mode='fork' "
                          "(its whole state) or 'weights_only' (its weights)")
    if resume_from is not None:
        _require_run_dir(Path(resume_from))
        resume_from = Path(resume_from).resolve()  # ".", a symlink: the run itself (its lease, its id)
    if stateful:
        assert resume_from is not None
        if run_id not in (None, resume_from.name):
            raise ConfigError(
                f"a stateful resume continues run {resume_from.name!r}; run_id={run_id!r} names another run "
                "(use resume_mode='weights_only' to start a new run from its weights)"
            )
        runs_root, run_id = resume_from.parent, validate_run_id(resume_from.name)
    else:
        run_id = run_id or new_run_id()
    return stateful, (Path(resume_from) if resume_from is not None else None), runs_root, run_id


def _has_last(run_dir: Path) -> bool:
    """Whether the log of ``run_dir`` holds a ``last_committed`` (a log that cannot be read counts as
    holding one: the stateful resume then names what is wrong, and nothing is cleared)."""
    try:
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as event_log:
            return any(True for _ in event_log.read(kinds=("last_committed",)))
    except Exception:  # noqa: BLE001 - never clear what cannot be read
        return True


def _require_run_dir(source: Path) -> None:
    """Refuse a ``resume_from`` that is not a run directory (a runs root, a file, a typo).

    Raises:
        ResumeError: ``source`` has no ``events.lmdb`` directory (named, with the runs it
            holds when it is a runs root).
    """
    if (source / "events.lmdb").is_dir():
        return
    what = "does not exist" if not source.exists() else "is not a directory" if not source.is_dir() else ""
    runs = sorted(p for p in source.iterdir() if (p / "events.lmdb").is_dir()) if source.is_dir() else []
    hint = f"; it looks like a runs root: pass one of its runs, e.g. {str(runs[0])!r}" if runs else ""
    raise ResumeError(
        f"resume_from={str(source)!r} is not a run directory: it has no event log (no events.lmdb there"
        f"{', it ' + what if what else ''}){hint}; nothing was restored or written"
    )


def _check_same_recipe(components: RunComponents, mine: RunStarted, started: RunStarted | None,
                       manifest: Manifest, *, fork: bool = False) -> None:
    """A stateful resume continues the same recipe: optimizers, schedulers, monitor, window, loss
    (:mod:`nnx_es.declare`), history journal, averaging update hooks, and a callback for every
    callback state LAST holds. A ``fork`` writes its own run and journal: its history journal may differ.

    The averaging hooks (:class:`~nnx_es.update_hooks.EMA`) are not declared in ``run_started``:
    they are read from the LAST ``manifest``'s ``update_hook/<name>`` components, in order (the
    first is the one validation evaluates). Another set would drop or restart the averaged
    weights and let BEST compare averaged against raw scores. Their ``decay`` is recorded
    nowhere and is not checked.

    Raises:
        ResumeError: naming what differs from the run's ``run_started`` declaration or its LAST.
    """
    theirs = [n.removeprefix("update_hook/") for n in manifest.components if n.startswith("update_hook/")]
    ours = [h.name for h in components.averages]
    if theirs != ours:
        raise ResumeError(
            f"cannot resume run {manifest.run_id!r} statefully with other averaging update hooks: its LAST "
            f"holds EMA state {theirs}, this trainer has EMA hooks named {ours} (the averaged weights would be "
            "dropped or restarted); pass the run's EMA hooks (EMA(decay, name=...)) in the same order, or use "
            "resume_mode='weights_only' to start a new run; nothing was restored or written"
        )
    held = [n.removeprefix("callback/") for n in manifest.components if n.startswith("callback/")]
    dropped = sorted(set(held) - {cb.name for cb in components.callbacks})
    if dropped:
        raise ResumeError(
            f"cannot resume run {manifest.run_id!r} statefully without its callback(s) {dropped}: its LAST holds "
            f"their state (early stopping's patience, a callback's counters) and the run would go on deciding "
            f"without them; pass them again (same names), or use resume_mode='weights_only' to start a new "
            "run; nothing was restored or written"
        )
    check_same_loaders(manifest.run_id, started.loaders if started else None, components.loaders)
    if started is None:
        return
    _check_same_spec(started, mine, fork=fork)
    for field, label in (("optimizers", "optimizers"), ("schedulers", "schedulers"), ("monitor", "monitor"),
                         ("accumulation", "accumulation window"), ("update", "precision or gradient clipping"),
                         ("objective", "loss"), ("models", "models (a frozen model's weights, by hash)"),
                         ("history", "history journal (history=: its records would be split between the log and "
                                     "the journal, or chunked otherwise)")):
        if (field == "history" and fork) or (field == "accumulation" and components.resizable):
            continue  # elastic mode: the window follows the world size (nnx_es.distributed.resize)
        theirs, ours = getattr(started, field), getattr(mine, field)
        if theirs != ours and not (field in ("update", "objective", "models", "history") and theirs is None):  # None: an older run declared none
            raise ResumeError(
                f"cannot resume run {started.run_id!r} statefully with a different {label}: the run declared "
                f"{theirs!r}, this trainer has {ours!r} (use resume_mode='weights_only' to start a new run); "
                "nothing was restored or written"
            )


def _check_same_spec(started: RunStarted, mine: RunStarted, *, fork: bool) -> None:
    """A stateful resume or a fork restores the run's whole state -- its optimizers' learning rates and
    other settings among it -- so a spec other than the one the run recorded would be silently overridden
    or mixed with it: refused, naming every path that differs (:func:`events.specs.spec_differences`).
    Only :data:`~events.specs.RESUMABLE_SPEC_FIELDS` (``epochs``) may differ. Compared when both the run
    and this trainer record a spec (``recipe_required=True``, ``Trainer(spec=...)``, the ``nnx-es`` CLI).

    Raises:
        ResumeError: naming the differing paths, each with the run's value and the one given.
    """
    if started.spec is None or mine.spec is None:
        return
    differs = spec_differences(started.spec, mine.spec)
    if not differs:
        return
    shown = "; ".join(differs[:8]) + (f"; and {len(differs) - 8} more" if len(differs) > 8 else "")
    what = "fork" if fork else "resume"
    raise ResumeError(
        f"cannot {what} run {started.run_id!r} with a spec other than the one it recorded ({shown}): a "
        f"{'fork' if fork else 'stateful resume'} restores the run's whole state (its optimizers' learning rates "
        "among it), which would silently override or mix with these; only 'epochs' may differ. Continue it with "
        "its own spec (nnx-es resume without --spec), or train the new settings as a new run: nnx-es run SPEC from "
        "scratch, or from Python fit(resume_from=..., resume_mode='weights_only') from its weights; nothing was "
        "restored or written"
    )


def _load_from(components: RunComponents, source: Path, *, own: Path, at: int | str | None, fork: bool,
               declared: RunStarted) -> tuple[SourceRef, dict[str, Any]]:
    """Load ``source``'s verified LAST (or the committed one ``at`` names) into ``components``; return
    the source reference. ``own``: the new run's directory (never its own source).

    ``fork``: the whole state (as a stateful resume restores it, after the same recipe checks against
    the source's ``run_started``), except what counts the new run's own epochs: its monitor starts
    afresh (its BEST is the best of its own epochs) and its schedulers count their steps from 0
    (their torch state goes on). Otherwise the model weights alone.
    """
    what = "fork" if fork else "weights_only continuation"
    if source.resolve() == own.resolve():
        raise ConfigError(f"a {what} must write its own run, not its source {source}")
    if not (source / "events.lmdb" / "data.mdb").exists():
        raise ResumeError(f"cannot start from {source}: it has no event log; nothing was restored or written")
    with LmdbLog(source / "events.lmdb", readonly=True) as src_log:
        point = find_resume_point(source, src_log, at=at)
        if fork:
            _check_same_recipe(components, declared, point.started, point.manifest, fork=True)
        loaded = load_state(BlobStore(source / "blobs", log=src_log), point.manifest)
    apply_loaded(components, loaded, fork=fork)
    return SourceRef(run_id=point.run_id, last_seq=point.last_seq, manifest=point.manifest_hash,
                     state="full" if fork else "weights"), loaded


def apply_loaded(components: RunComponents, loaded: dict[str, Any], *, fork: bool) -> None:
    """Restore a new run's start from another run's checkpoint state ``loaded``: its weights alone,
    or (``fork``) the whole state but what counts the new run's own epochs -- a fresh monitor, and
    schedulers counting their steps from 0 (their torch state goes on)."""
    fresh_monitor = components.monitor.state_dict() if components.monitor is not None else None
    apply_state(components, loaded, weights_only=not fork)
    if fork:
        for s in components.schedulers:
            s.steps = 0  # the new run's scheduler_stepped events count its own steps
        if components.monitor is not None and fresh_monitor is not None:
            components.monitor.load_state_dict(fresh_monitor)


def _follow(world: World, *, runs_root: Path, run_id: str | None, resume_from: str | Path | None, seed: int,
            components: RunComponents) -> Session:
    """A rank that is not the writer: take the writer's verdict (its refusal, raised here alike), then
    restore what the writer restored and fold the run's events in memory (``nnx_es.distributed.follower``);
    this rank never opens, creates or reads a file of the run (spec 000 §3 "One writer")."""
    from nnx_es.distributed.follower import FollowerBlobStore, FollowerLog

    verdict = world.share(None)
    if not verdict["ok"]:
        raise_described(verdict["error"])
    run_id = verdict["run_id"]
    runs_root = Path(verdict["runs_root"])
    seed_everything(seed, rank=world.rank, world_size=world.size)
    log_ = FollowerLog(verdict["next_seq"])
    store = FollowerBlobStore(runs_root / run_id / "blobs")
    checkpoints = CheckpointsState()
    if verdict["stateful"]:
        apply_state(components, verdict["state"])
        recorder = Recorder(log_, Lifecycle(verdict["lifecycle"]), counters=verdict["counters"])
        checkpoints = verdict["checkpoints"]
    else:
        if verdict["loaded"] is not None:
            apply_loaded(components, verdict["loaded"], fork=verdict["fork"])
        recorder = Recorder(log_)
    state = RunState(run_id=run_id, runs_root=runs_root, recorder=recorder, store=store, world=world)
    stop = verdict.get("stop")
    if stop is not None and stop != "update_boundary":
        state.request_stop(stop, "resume")
    return Session(state=state, opening=verdict["opening"], start_epoch=verdict["start_epoch"],
                   checkpoints=checkpoints)


# NNX_ES_KILL_AT (nnx_es.injection): read once, when the session opener is imported (before any
# run opens); unset, nothing is installed and the hot path is the recorder as written
if os.environ.get(ENV_VAR):
    install_from_environment()
