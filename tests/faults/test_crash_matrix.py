"""The crash matrix: SIGKILL a run at every event boundary, inside every blob write and
around every commit sync; after each kill the run audits clean, its committed view is the
uninterrupted run's view at the same LAST, LAST is a complete verified checkpoint, and a
resume reaches the uninterrupted run's final parameters bitwise.

The reference run (3 epochs, accumulation 2, ReduceLROnPlateau on ``val_loss``, BEST,
rotating phase checkpoints, a callback with state and with its own checkpoint bytes) runs
uninterrupted once per commit mode (LAST at the epoch's end, and deferred by one update
with its blobs persisted on a background thread: ``checkpoint_lag=1``); every crash point
is then a fresh run forked from this warm process (:mod:`crashkit`) and killed at that
point. The points are split between two forked workers (two cores).

Runs of the matrix live on tmpfs when the machine has one (``/dev/shm``): a SIGKILL leaves
the page cache intact, so what survives a process kill is the same on tmpfs as on disk,
while the ~110 fsyncs of every run (twice per point: the killed run and its resume) would
otherwise dominate the matrix's time. ``NNX_ES_CRASH_DIR`` overrides the location.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch import nn

from crashkit import (
    install_storage_hook,
    kill_at_event,
    kill_at_sync,
    kill_in_storage_io,
    run_killed,
    uninstall_storage_hook,
)
from events.log import LmdbLog
from events.schema import Event, LastCommitted
from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.checkpoint import INLINE_MAX, read_manifest, verify_checkpoint
from nnx_es.errors import ResumeError
from nnx_es.storage import BlobStore
from nnx_es.testing.reference import Reference as PublicReference
from projections import Projections, project
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)  # fork-safe parent

pytestmark = pytest.mark.slow

EPOCHS = 3
RUN_ID = "r"
WORKERS = 2
_TIME_FIELDS = frozenset({"wall_time_s", "duration_s"})


class Tally(Callback):
    """A callback with restart-critical state and a deferred checkpoint of its own each epoch."""

    def __init__(self) -> None:
        self.epochs = 0
        self.updates = 0

    def on_optimizer_update(self, ctx, receipt):
        self.updates += 1

    def on_epoch_end(self, ctx):
        self.epochs += 1

    def state_dict(self):
        return {"epochs": self.epochs, "updates": self.updates}

    def load_state_dict(self, state):
        self.epochs, self.updates = state["epochs"], state["updates"]

    def checkpoint(self, ctx):
        return f"tally epoch={ctx.epoch} updates={self.updates}".encode()


def make_trainer(runs: Path, run_id: str | None, lag: int = 0) -> Trainer:
    net = small_net(0)
    # a model state above INLINE_MAX: every checkpoint writes a blob file (the manifest goes to the log)
    net.register_buffer("ballast", torch.arange(INLINE_MAX // 4 + 1, dtype=torch.float32))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    return Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], callbacks=[Tally()],
        accumulation=2, phase_every=1, keep_phases=2, checkpoint_lag=lag, runs_root=runs, run_id=run_id, seed=0,
        progress=False, keep_last=None,  # every checkpoint kept: the reference reads each LAST
    )


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=8, n_train=32, n_val=24), epochs=EPOCHS, **kw)


# --- normal forms ------------------------------------------------------------------------


def _untimed(value: Any) -> Any:
    """Builtins of ``value`` with every wall-clock field zeroed (the only run-to-run difference)."""
    if isinstance(value, dict):
        return {k: (0.0 if k in _TIME_FIELDS else _untimed(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _events_untimed(events: list[tuple[int, Event]]) -> list[Any]:
    return [(seq, _untimed(msgspec.to_builtins(e))) for seq, e in events]


def _at_last(p: Projections) -> dict[str, Any]:
    """What the committed view says as of its LAST: history, LAST pointer, counters, schedulers."""
    return {
        "history": [msgspec.structs.replace(r, wall_time_s=0.0) for r in p.history.records],
        "last": p.checkpoints.last,
        "counters": p.counters,
        "schedulers": p.schedulers,
    }


def _temporaries(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob(".*.tmp"))


# --- the reference run -------------------------------------------------------------------


@dataclass
class Reference:
    lag: int  # the trainer's checkpoint_lag: 0 commits at the epoch's end, 1 defers LAST by one update
    params: dict[str, torch.Tensor]
    events: list[tuple[int, Event]]
    untimed: list[Any]
    history: list[Any]
    at_last: list[dict[str, Any]]  # k -> the committed view right after the (k+1)-th LAST
    last_manifests: list[str]
    storage_ops: list[tuple[str, str]]  # (op, caller) of every counted os call
    syncs: int
    final_checkpoints: Any  # the checkpoints projection of the reference's whole log
    writes: int  # atomic writes (each: write, fsync, replace, directory fsync)
    created_dirs: int  # directories the run's atomic writes created
    blob_files: set[str]  # blobs stored as files: the components not kept inside their manifest
    public: PublicReference  # the same run, as nnx_es.testing checks users' runs against it


@pytest.fixture(scope="module", params=[0, 1], ids=["commit-at-epoch-end", "deferred-commit"])
def reference(request, tmp_path_factory) -> Reference:
    lag = request.param
    runs = tmp_path_factory.mktemp("reference")
    fit(make_trainer(runs / "warm", "warm", lag))  # warm every code path before the measured run
    ops: list[tuple[str, str]] = []
    install_storage_hook(lambda op, caller, index, when, args: ops.append((op, caller)) if when == "before" else None)
    try:
        trainer = make_trainer(runs, RUN_ID, lag)
        run = fit(trainer)
    finally:
        uninstall_storage_hook()
    events = read_events(run.run_dir)
    last_seqs = [s for s, e in events if isinstance(e, LastCommitted)]
    assert audit_run(Path(run.run_dir)).ok
    return Reference(
        lag=lag,
        params={k: v.clone() for k, v in trainer.net.state_dict().items()},
        events=events,
        untimed=_events_untimed(events),
        history=[msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history],
        at_last=[_at_last(project(events[: s + 1])) for s in last_seqs],
        last_manifests=[e.manifest for _, e in events if isinstance(e, LastCommitted)],
        storage_ops=ops,
        syncs=trainer.recorder.log.syncs,
        final_checkpoints=project(events).checkpoints,
        writes=sum(1 for op, caller in ops if op == "replace"),
        created_dirs=sum(1 for d in Path(run.run_dir).rglob("*") if d.is_dir() and "events.lmdb" not in d.parts),
        blob_files=_blob_files(run.run_dir, events),
        public=PublicReference.of(Path(run.run_dir)),
    )


def _blob_files(run_dir: Path, events: list[tuple[int, Event]]) -> set[str]:
    """The blobs stored as files: components too big to sit inside their manifest. Manifests and
    the (small) callback checkpoints are values of the log, written with LAST: checked here."""
    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        store = BlobStore(Path(run_dir) / "blobs", log=log)
        in_log = {e.blob for _, e in events if e.KIND == "callback_checkpointed"}
        files: set[str] = set()
        for _, e in events:
            if e.KIND == "checkpoint_stored":
                manifest = read_manifest(store, e.manifest)
                in_log.add(e.manifest)
                files |= {c.blob for c in manifest.components.values() if c.data is None}
                assert set(e.components) == set(manifest.components)
        assert all(log.get_blob(d.encode()) is not None and not store.path(d).exists() for d in in_log)
    return files


@pytest.fixture(scope="module")
def crash_dir(tmp_path_factory) -> Iterator[Path]:
    base = os.environ.get("NNX_ES_CRASH_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    if base is None:
        yield tmp_path_factory.mktemp("crash")
        return
    path = Path(tempfile.mkdtemp(prefix="nnx_es_crash_", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- one crash point ---------------------------------------------------------------------


@dataclass
class Point:
    name: str
    kill: Callable[[], None]


def check_point(ref: Reference, runs: Path, point: Point) -> str:
    """Kill a fresh run at ``point``, check everything the matrix promises; return what happened.

    Returns ``"resumed"`` (a LAST was durable: resumed to the reference's final parameters)
    or ``"refused"`` (no LAST was durable yet: the resume is refused with ResumeError).
    """
    run_dir = runs / RUN_ID
    outcome = run_killed(lambda: fit(make_trainer(runs, RUN_ID, ref.lag)), point.kill)
    assert outcome == "killed", f"the child was not killed at the point: {outcome}"
    # the public harness's checks (nnx_es.testing): prefix of the reference log, audit, committed
    # view and LAST at the same LAST; a Finding names what differs. Then the matrix's own, as strict.
    ref.public.check_committed(run_dir, ref.public.check_prefix(run_dir))
    events = read_events(run_dir)
    # the killed run wrote an exact prefix of the reference log (wall-clock fields aside)
    assert _events_untimed(events) == ref.untimed[: len(events)], "log is not a prefix of the reference log"
    # (a) the replay audit holds on the crashed run
    report = audit_run(run_dir)
    assert report.ok, f"audit after the kill: {[v.line() for v in report.violations]}"
    p = project(events)
    k = p.checkpoints.commits
    if k == 0:
        # nothing durable to resume from: refused with a named reason, nothing written
        try:
            fit(make_trainer(runs, None, ref.lag), resume_from=run_dir)
        except ResumeError as exc:
            assert "no committed LAST" in str(exc), str(exc)
        else:
            raise AssertionError("a resume without a durable LAST was not refused")
        assert read_events(run_dir) == events, "a refused resume appended to the log"
        report = audit_run(run_dir)
        assert report.ok, f"audit after the refused resume: {[v.line() for v in report.violations]}"
        return "refused"
    # (b) the committed view is the uninterrupted run's view at the same LAST
    got, want = _at_last(p), ref.at_last[k - 1]
    for field in want:
        assert got[field] == want[field], f"committed {field} differs from the reference at LAST #{k}"
    # (c) LAST is a complete checkpoint: the reference's k-th LAST, every blob verified
    assert p.checkpoints.last.manifest == ref.last_manifests[k - 1]
    verify_checkpoint(BlobStore(run_dir / "blobs"), p.checkpoints.last.manifest, run_id=RUN_ID)
    # (d) the resume reaches the reference's final parameters bitwise, and audits clean
    trainer = make_trainer(runs, None, ref.lag)
    run = fit(trainer, resume_from=run_dir)
    for name, value in trainer.net.state_dict().items():
        assert torch.equal(value, ref.params[name]), f"parameter {name} differs after the resume"
    assert [msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history] == ref.history
    assert run.status == "completed"
    ref.public.check_resumed(run_dir, run.status)  # history, LAST/BEST/phases/callbacks, temporaries, audit
    # BEST, the phases and the callback checkpoints end where the uninterrupted run's do
    final = project(read_events(run_dir)).checkpoints
    for field in ("last", "best", "phases", "callbacks"):
        assert getattr(final, field) == getattr(ref.final_checkpoints, field), f"{field} differs after the resume"
    assert _temporaries(run_dir) == [], "the resume left temporaries"
    report = audit_run(run_dir)
    assert report.ok, f"audit after the resume: {[v.line() for v in report.violations]}"
    return "resumed"


def run_points(ref: Reference, root: Path, points: list[Point]) -> dict[str, Any]:
    """Check every point, split across :data:`WORKERS` forked workers; return the tally.

    Each worker reports ``{"outcomes": {name: outcome}, "failures": {name: message}}``
    through a pipe; a worker that dies without reporting is a failure of its points.
    """
    root.mkdir(parents=True, exist_ok=True)
    chunks = [points[i::WORKERS] for i in range(WORKERS)]
    children: list[tuple[int, int, list[Point]]] = []
    for w, chunk in enumerate(chunks):
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # worker
            os.close(r)
            result: dict[str, dict[str, str]] = {"outcomes": {}, "failures": {}}
            try:
                for i, point in enumerate(chunk):
                    runs = root / f"w{w}-{i}"
                    try:
                        result["outcomes"][point.name] = check_point(ref, runs, point)
                    except BaseException as exc:  # noqa: BLE001 - reported to the parent
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                        result["failures"][point.name] = f"{type(exc).__name__}: {first}"[:400]
                    finally:
                        shutil.rmtree(runs, ignore_errors=True)
                with os.fdopen(wfd, "wb") as f:
                    f.write(json.dumps(result).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        children.append((pid, r, chunk))
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    for pid, r, chunk in children:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if not data:
            failures.update({p.name: f"worker died (status {status})" for p in chunk})
            continue
        result = json.loads(data)
        outcomes.update(result["outcomes"])
        failures.update(result["failures"])
    return {"outcomes": outcomes, "failures": failures}


def _assert_all_pass(tally: dict[str, Any], points: list[Point]) -> None:
    failures = tally["failures"]
    assert not failures, f"{len(failures)} of {len(points)} crash points failed:\n" + "\n".join(
        f"  {name}: {msg}" for name, msg in failures.items()
    )
    assert sorted(tally["outcomes"]) == sorted(p.name for p in points)


# --- the matrix ----------------------------------------------------------------------------

EXERCISED: dict[tuple[int, str], dict[str, str]] = {}  # (lag, family) -> point -> outcome


def test_sigkill_before_every_event_audits_clean_and_resumes_bitwise(reference, crash_dir):
    points = [
        Point(f"event {n} ({e.KIND})", kill_at_event(n)) for n, (_, e) in enumerate(reference.events)
    ]
    tally = run_points(reference, crash_dir / f"lag{reference.lag}-events", points)
    _assert_all_pass(tally, points)
    EXERCISED[reference.lag, "event boundaries"] = tally["outcomes"]
    # kills before the initial LAST is durable (events 0..its seq) are refused, all others resume
    first_last = next(s for s, e in reference.events if isinstance(e, LastCommitted))
    refused = sorted(n for n, (_, e) in enumerate(reference.events) if tally["outcomes"][points[n].name] == "refused")
    assert refused == list(range(first_last + 1))


def test_sigkill_inside_every_blob_write_audits_clean_and_resumes_bitwise(reference, crash_dir):
    points = [
        Point(f"storage op {i} {when} os.{op} ({caller})", kill_in_storage_io(i, after=when == "after"))
        for i, (op, caller) in enumerate(reference.storage_ops)
        for when in ("before", "after")
    ]
    tally = run_points(reference, crash_dir / f"lag{reference.lag}-blobs", points)
    _assert_all_pass(tally, points)
    EXERCISED[reference.lag, "blob and view writes"] = tally["outcomes"]
    # the first checkpoint's blobs are written before the initial LAST: those kills are refused
    assert "refused" in tally["outcomes"].values() and "resumed" in tally["outcomes"].values()


def test_sigkill_just_before_and_after_every_commit_sync(reference, crash_dir):
    points = [
        Point(f"sync {i} {when}", kill_at_sync(i, after=when == "after"))
        for i in range(reference.syncs)
        for when in ("before", "after")
    ]
    tally = run_points(reference, crash_dir / f"lag{reference.lag}-syncs", points)
    _assert_all_pass(tally, points)
    EXERCISED[reference.lag, "commit syncs"] = tally["outcomes"]
    # before the initial LAST's sync nothing is durable; right after it, LAST is
    assert tally["outcomes"]["sync 0 before"] == "refused"
    assert tally["outcomes"]["sync 0 after"] == "resumed"
    assert all(v == "resumed" for k, v in tally["outcomes"].items() if k != "sync 0 before")


def test_the_matrix_covers_every_point_of_the_reference_run(reference):
    """The size of the matrix follows from the reference run's structure (printed with -s)."""
    kinds = [e.KIND for _, e in reference.events]
    # initial LAST, one per epoch, the final LAST after finalization, and run_finalized
    assert reference.syncs == 1 + EPOCHS + 1 + 1 == kinds.count("last_committed") + kinds.count("run_finalized")
    # each batch of atomic writes (a checkpoint's large blobs, the two
    # views) writes and fsyncs every temporary, renames them all, fsyncs their directory once,
    # then the parent of each directory it had to create (blobs/, blobs/sha256/, views/)
    code = {("write", "atomic_write_all"): "w", ("fsync", "atomic_write_all"): "f",
            ("replace", "atomic_write_all"): "r",
            ("fsync", "fsync_dir"): "d"}
    ops = "".join(code[op] for op in reference.storage_ops)
    # first, the new log's directory entries: events.lmdb/ (data.mdb's), the run's directory, the runs root
    # (durable before anything commits: docs/INVARIANTS.md "Power loss")
    assert ops.startswith("ddd"), ops
    ops = ops[3:]
    batches = re.findall(r"((?:wf)+)(r+)(d+)", ops)
    assert "".join("".join(b) for b in batches) == ops, ops
    assert all(len(w) == 2 * len(r) for w, r, _ in batches), ops  # every temporary is renamed
    assert ops.count("w") == reference.writes
    assert ops.count("d") - len(batches) == reference.created_dirs
    # blob files written (new content only; small components live in their manifest, manifests in
    # the log) plus the two view files
    assert reference.writes == len(reference.blob_files) + 2
    expected = {
        "event boundaries": len(reference.events),
        "blob and view writes": 2 * len(reference.storage_ops),
        "commit syncs": 2 * reference.syncs,
    }
    total = sum(expected.values())
    print(f"\ncrash matrix (checkpoint_lag={reference.lag}): {expected} = {total} crash points")
    ran = {family: v for (lag, family), v in EXERCISED.items() if lag == reference.lag}
    if set(ran) == set(expected):  # the whole module ran: every point was exercised
        assert {k: len(v) for k, v in ran.items()} == expected
        resumed = sum(1 for v in ran.values() for o in v.values() if o == "resumed")
        print(f"crash matrix (checkpoint_lag={reference.lag}): {resumed} resumed bitwise, "
              f"{total - resumed} refused (no durable LAST yet)")
