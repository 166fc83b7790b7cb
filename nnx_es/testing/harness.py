"""Crash and write-fault tests of a user's own training set-up.

    report = crash_test(build, epochs=3, points=50)
    assert report.ok, report

1. ``build(runs_root, run_id)`` makes a :class:`Fit` (a ``Trainer`` or ``NNModel`` built with
   that ``runs_root`` and ``run_id``, its loaders, and for ``NNModel`` the ``train`` keywords);
   the global RNGs are seeded with ``seed`` before every call, so two calls build the same thing.
2. The reference: one uninterrupted fit, counting its points (:mod:`nnx_es.injection`): every
   event boundary; before and after every durable file write step (write, fsync, rename,
   directory fsync) and every synced commit of the log.
3. Each chosen point runs in a process forked from this warm one (no new interpreter): a
   fresh fit SIGKILLed at the point (``crash_test``) or failing there with an errno
   (``fault_test``); then the checks of :class:`~nnx_es.testing.reference.Reference` and a
   resume (``resume_from=``) that must reach the reference's final state bitwise. Points are
   split between ``workers`` forked workers.

Runs live under ``runs_root`` (default: a temporary directory on tmpfs when the machine has
``/dev/shm`` -- a SIGKILL keeps the page cache, so what survives a process kill is the same
there as on disk, without the cost of the fsyncs -- removed afterwards).
"""

from __future__ import annotations

import errno as errno_module
import json
import math
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from nnx_es.errors import ConfigError, ResumeError
from nnx_es.injection import (Point, Recording, install_fault, install_kill, mark_kills_expected, record_persistence,
                              uninstall)
from nnx_es.testing.reference import Finding, Reference, read_log
from nnx_es.testing.report import CrashReport, Failure, FaultReport, Report

__all__ = ["Build", "Fit", "Points", "crash_test", "fault_test"]

RUN_ID = "crashtest"
_STEP_NAMES = {("write", "atomic_write_all"): "write of a temporary file", ("fsync", "atomic_write_all"): "fsync of a file",
               ("replace", "atomic_write_all"): "rename into place", ("fsync", "fsync_dir"): "directory fsync"}


@dataclass(frozen=True)
class Fit:
    """What one fit needs. trainer: a :class:`~nnx_es.trainer.Trainer` or an
    :class:`~nnx_es.nnmodel.NNModel`; train_loader / val_loader: as ``fit`` takes them;
    kwargs: for an ``NNModel``, the keywords of :meth:`~nnx_es.nnmodel.NNModel.train`
    (optimizer, loss, monitor, callbacks, ``runs_root``, ``run_id``...; not ``epochs`` or
    ``resume_from``, which the harness gives)."""

    trainer: Any
    train_loader: Iterable[Any]
    val_loader: Iterable[Any] | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def run(self, *, epochs: int, resume_from: Path | None = None) -> Any:
        """Fit (or resume) and return the :class:`~nnx_es.result.RunResult`."""
        from nnx_es.nnmodel import NNModel

        if isinstance(self.trainer, NNModel):
            return self.trainer.train(self.train_loader, self.val_loader, epochs=epochs, resume_from=resume_from,
                                      **self.kwargs)
        if self.kwargs:
            raise ConfigError(f"Fit.kwargs are NNModel.train keywords; a Trainer takes them itself, got {dict(self.kwargs)}")
        return self.trainer.fit(self.train_loader, self.val_loader, epochs=epochs, resume_from=resume_from)


#: ``build(runs_root, run_id)``: a :class:`Fit`, or a ``(trainer, train_loader[, val_loader])`` tuple
Build = Callable[[Path, str], Union[Fit, Sequence[Any]]]
Points = Union[None, int, Literal["all"]]


def _as_fit(made: Any) -> Fit:
    if isinstance(made, Fit):
        return made
    if isinstance(made, (tuple, list)) and 2 <= len(made) <= 3:
        return Fit(*made)
    raise ConfigError(f"build(runs_root, run_id) must return a Fit or (trainer, train_loader[, val_loader]), got {made!r}")


def seed_globals(seed: int) -> None:
    """Seed the global RNGs a set-up may draw from before its trainer seeds its own: Python's
    ``random``, NumPy's and torch's default generator."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Job:
    """One user set-up: builds and fits it with seeded global RNGs."""

    def __init__(self, build: Build, epochs: int, seed: int) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs must be an int >= 1, got {epochs!r}")
        self.build, self.epochs, self.seed = build, epochs, seed

    def fit(self, runs: Path, resume: bool = False) -> Any:
        seed_globals(self.seed)
        spec = _as_fit(self.build(runs, RUN_ID))
        return spec.run(epochs=self.epochs, resume_from=runs / RUN_ID if resume else None)


# --- the points ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    point: Point
    where: str
    position: float  # where in the run: events emitted before it (+ a fraction for order)


def persistence_sites(ref: Reference, rec: Recording, *, kills: bool) -> list[Site]:
    sites: list[Site] = []
    if kills:
        sites += [Site(Point("event", n), ref.describe_event(n), n) for n in range(len(ref.events))]
    whens = ("before", "after") if kills else ("before",)
    for i, ((op, caller), at) in enumerate(zip(rec.storage_ops, rec.storage_at)):
        for w in whens:
            step = _STEP_NAMES.get((op, caller), f"os.{op} ({caller})")
            sites.append(Site(Point("io", i, w), f"{w} persistence step {i}: {step}, after event seq {at - 1}",
                               at - 0.5 + i * 1e-6))
    for i, at in enumerate(rec.sync_at):
        for w in whens:
            sites.append(Site(Point("sync", i, w), f"{w} the log's synced commit #{i} (events up to seq {at - 1})",
                               at - 0.25 + i * 1e-6))
    return sorted(sites, key=lambda s: (s.position, s.point.when == "after"))


def choose_points(sites: list[Site], points: Points, seed: int) -> list[Site]:
    """Every site, or ``points`` of them spread over the run: the run's timeline is cut into
    equal strata per family (events, file writes, log syncs) and one site is drawn from each
    (``random.Random(seed)``); file writes and syncs get at least a sixth of the budget each."""
    if points is None or points == "all":
        return sites
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ConfigError(f"points must be None, 'all' or an int >= 1, got {points!r}")
    if points >= len(sites):
        return sites
    rng = random.Random(seed)
    families: dict[str, list[Site]] = {}
    for s in sites:
        families.setdefault(s.point.kind, []).append(s)
    floor = math.ceil(points / 6)
    quota = {k: min(len(v), floor) for k, v in families.items() if k != "event"}
    rest = points - sum(quota.values())
    others = {k: v for k, v in families.items() if k not in quota}
    for k, v in others.items():
        quota[k] = min(len(v), rest)
    left = points - sum(quota.values())
    for k in sorted(families, key=lambda k: -len(families[k])):  # anything unspent goes to the biggest family
        extra = min(left, len(families[k]) - quota[k])
        quota[k] += extra
        left -= extra
    chosen: list[Site] = []
    for k, members in families.items():
        n = quota[k]
        for j in range(n):
            lo, hi = (j * len(members)) // n, ((j + 1) * len(members)) // n
            chosen.append(members[rng.randrange(lo, max(hi, lo + 1))])
    return sorted(set(chosen), key=sites.index)


# --- one point -------------------------------------------------------------------------------


def read_until_exit(pid: int, r: int) -> tuple[bytes, int]:
    """Read the pipe ``r`` of the forked child ``pid`` until the child has exited; return what it
    wrote and its wait status. Closes ``r``.

    Not until the pipe's end alone: a process the child forked (a DataLoader worker) inherits the
    write end and may hold it open after the child is SIGKILLed -- until it notices, or forever
    if it is stuck -- which would hang the reader. Reads as the child writes (no full-pipe stall).
    """
    import select

    chunks: list[bytes] = []
    status: int | None = None
    try:
        while True:
            ready, _, _ = select.select([r], [], [], 0.5)
            if ready:
                chunk = os.read(r, 65536)
                if not chunk:
                    break  # every writer closed its end
                chunks.append(chunk)
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                os.set_blocking(r, False)
                try:  # what the child wrote before it exited is in the pipe now
                    while chunk := os.read(r, 65536):
                        chunks.append(chunk)
                except BlockingIOError:
                    pass
                break
    finally:
        os.close(r)
    if status is None:
        _, status = os.waitpid(pid, 0)
    return b"".join(chunks), status


def run_in_child(target: Callable[[], Any]) -> str:
    """Run ``target`` in a forked child: ``"killed"``, ``"completed"`` or ``"error: <type>: <message>"``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code
        os.close(r)
        mark_kills_expected()
        code = 0
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(w, f"{type(exc).__name__}: {exc}".encode()[:2000])
            code = 3
        finally:
            os.close(w)
            os._exit(code)
    os.close(w)
    data, status = read_until_exit(pid, r)
    message = data.decode(errors="replace")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "completed"
    return f"error: {message or status}"


def resume_and_check(resume: Callable[[], Any], ref: Reference, runs: Path, k: int,
                     refusals: tuple[type[BaseException], ...] = (ResumeError,)) -> str:
    """Resume the interrupted run ``runs/<RUN_ID>`` with ``resume()`` (a fit with ``resume_from=``;
    returns its result, or raises :class:`ResumeError` when it refuses) and check it ends as the
    reference did; with no LAST yet (``k == 0``) the resume must be refused (one of ``refusals``
    raised) and write nothing. Returns ``"resumed"`` or ``"refused"``; raises :class:`Finding` otherwise."""
    run_dir = runs / RUN_ID
    if k == 0:
        before = len(read_log(run_dir)) if (run_dir / "events.lmdb" / "data.mdb").exists() else 0
        try:
            resume()
        except refusals:
            after = len(read_log(run_dir)) if (run_dir / "events.lmdb" / "data.mdb").exists() else 0
            if after != before:
                raise Finding("a refused resume writes nothing", f"{before} events", f"{after}") from None
            return "refused"
        raise Finding("a resume before any LAST commit is refused", "ResumeError", "the resume ran")
    try:
        result = resume()
    except Exception as exc:  # noqa: BLE001 - named in the finding
        raise Finding("the run resumes from its LAST", "a completed resume", f"{type(exc).__name__}: {exc}") from None
    ref.check_resumed(run_dir, result.status)
    return "resumed"


def _crash_point(job: Job, ref: Reference, runs: Path, site: Site, fault: int | None) -> str:
    del fault
    outcome = run_in_child(lambda: (install_kill(site.point), job.fit(runs)))
    if outcome != "killed":
        raise Finding("the run is killed at the point", "SIGKILL", outcome)
    events = ref.check_prefix(runs / RUN_ID)
    k = ref.check_committed(runs / RUN_ID, events)
    return resume_and_check(lambda: job.fit(runs, resume=True), ref, runs, k)


def _fault_point(job: Job, ref: Reference, runs: Path, site: Site, fault: int | None) -> str:
    assert fault is not None
    install_fault(site.point, fault)
    try:
        job.fit(runs)
    except Exception as exc:  # noqa: BLE001 - checked below
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    finally:
        uninstall()
    text = os.strerror(fault)
    if error is None:
        raise Finding("the write fault ends the fit with an error", f"an error naming {text!r}", "fit returned")
    if text not in error:
        raise Finding("the error names the fault", f"{text!r} in the message", error[:300])
    run_dir = runs / RUN_ID
    if not (run_dir / "events.lmdb").exists():
        return "refused"
    k = ref.check_committed(run_dir)
    ref.check_no_temporaries(run_dir, "after the fault")
    return resume_and_check(lambda: job.fit(runs, resume=True), ref, runs, k)


def _check(check: Callable[..., str], job: Job, ref: Reference, root: Path, name: str, site: Site,
           fault: int | None) -> tuple[str, dict[str, Any] | None]:
    runs = root / name.replace(":", "_").replace(" ", "_")
    try:
        return check(job, ref, runs, site, fault), None
    except Finding as f:
        return "failed", {"point": name, "where": site.where, "check": f.check, "expected": f.expected,
                          "found": f.found, "divergence": f.divergence}
    except Exception as exc:  # noqa: BLE001 - a harness-side surprise is a failure of the point too
        return "failed", {"point": name, "where": site.where, "check": "the point could be checked",
                          "expected": "no error", "found": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def _run_points(job: Job, ref: Reference, root: Path, tasks: list[tuple[str, Site, int | None]],
                check: Callable[..., str], workers: int) -> tuple[dict[str, str], list[Failure]]:
    """Check every task in ``workers`` forked workers; each reports its results through a pipe as JSON."""
    chunks = [tasks[i::workers] for i in range(workers) if tasks[i::workers]]
    children = []
    for chunk in chunks:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # worker
            os.close(r)
            mark_kills_expected()  # its resumes remove the killed runs' temporaries by design
            try:
                results = [(name, *_check(check, job, ref, root, name, site, fault)) for name, site, fault in chunk]
                with os.fdopen(w, "wb") as f:
                    f.write(json.dumps(results).encode())
            finally:
                os._exit(0)
        os.close(w)
        children.append((pid, r, chunk))
    outcomes: dict[str, str] = {}
    failures: dict[str, Failure] = {}
    for pid, r, chunk in children:
        data, status = read_until_exit(pid, r)
        if not data:
            for name, site, _ in chunk:
                outcomes[name] = "failed"
                failures[name] = Failure(name, site.where, "the point could be checked", "a report from its worker",
                                         f"the worker died (wait status {status})")
            continue
        for name, outcome, failure in json.loads(data):
            outcomes[name] = outcome
            if failure is not None:
                failures[name] = Failure(**failure)
    order = [name for name, _, _ in tasks]
    return {n: outcomes[n] for n in order if n in outcomes}, [failures[n] for n in order if n in failures]


def work_root(runs_root: str | Path | None) -> tuple[Path, bool]:
    if runs_root is not None:
        Path(runs_root).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="nnx_es_crash_", dir=runs_root)), True
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="nnx_es_crash_", dir=base)), True


def run_harness(job: Any, points: Points, seed: int, runs_root: str | Path | None, workers: int | None,
                faults: Sequence[str] | None = None, epochs: int | None = None) -> Report:
    """The crash test (``faults`` None) or the fault test of ``job``: anything with
    ``fit(runs, resume=False)`` that fits (or resumes) the run ``runs/<RUN_ID>`` in this process
    and returns its result (``.status``), raising :class:`ResumeError` when a resume is refused
    (a :class:`Job`; ``nnx-es crashtest``'s script). Its reference fit runs here; every point in
    a process forked from this one. ``epochs``: the report's (default: the reference's epochs).

    Raises:
        ConfigError: a bad ``points`` or ``faults``.
        Exception: whatever the uninterrupted reference fit raised.
    """
    import torch

    t0 = time.perf_counter()
    codes: list[tuple[str, int]] = []
    for name in faults or ():
        code = getattr(errno_module, str(name), None)
        if not isinstance(code, int):
            raise ConfigError(f"faults must name errno codes ('ENOSPC', 'EIO', ...), got {name!r}")
        codes.append((str(name), code))
    n_workers = workers if workers is not None else max(1, min(2, os.cpu_count() or 1))
    root, owned = work_root(runs_root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # forked children must not inherit a busy intra-op pool
    try:
        rec = record_persistence()
        try:
            job.fit(root / "reference")
        finally:
            uninstall()
        ref = Reference.of(root / "reference" / RUN_ID)
        sites = persistence_sites(ref, rec, kills=faults is None)
        chosen = choose_points(sites, points, seed)
        if faults is None:
            tasks = [(str(s.point), s, None) for s in chosen]
            outcomes, failures = _run_points(job, ref, root / "points", tasks, _crash_point, n_workers)
            cls: type[Report] = CrashReport
            available = len(sites)
        else:
            tasks = [(f"{name} {s.point}", s, code) for name, code in codes for s in chosen]
            outcomes, failures = _run_points(job, ref, root / "points", tasks, _fault_point, n_workers)
            cls = FaultReport
            available = len(sites) * len(codes)
    finally:
        torch.set_num_threads(threads)
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    return cls(epochs=epochs if epochs is not None else len(ref.history), available=available, tried=tuple(n for n, _, _ in tasks), outcomes=outcomes,
               failures=tuple(failures), elapsed_s=time.perf_counter() - t0)


def crash_test(build: Build, *, epochs: int, points: Points = None, seed: int = 0,
               runs_root: str | Path | None = None, workers: int | None = None) -> CrashReport:
    """SIGKILL a fresh fit of ``build``'s set-up at each chosen point and check that it survives.

    At each point: the killed run wrote an exact prefix of the reference's log (wall-clock
    fields aside); the audit (``nnx_es.audit.audit_run``) holds; the committed view is the
    reference's at the same LAST; LAST is the reference's old or new checkpoint and every
    blob verifies; a resume (``resume_from=``) reaches the reference's final state bitwise --
    history, and LAST/BEST/phase/callback checkpoints (model, optimizer, scheduler, RNG
    streams, counters and callback state are in them) -- leaves no temporary and audits
    clean. Before the first LAST, the resume must be refused instead.

    Args:
        build: ``build(runs_root, run_id) -> Fit`` (or ``(trainer, train_loader[, val_loader])``);
            the trainer must use that ``runs_root`` and ``run_id``.
        epochs: the fit's ``epochs``.
        points: ``None`` or ``"all"``: every point (event boundaries, before/after every
            persistence step); ``N``: N points spread over the run, drawn with ``seed``
            (the same N and seed draw the same points).
        seed: seeds Python's, NumPy's and torch's global RNGs before every ``build`` call,
            and the draw of the points.
        runs_root: where the runs go (a temporary directory under it, removed afterwards);
            default: a temporary directory (on ``/dev/shm`` when there is one).
        workers: forked processes checking points side by side (default: 2, or 1 on one core).

    Returns:
        a :class:`~nnx_es.testing.report.CrashReport` (``assert report.ok, report``).

    Raises:
        ConfigError: a bad ``epochs``/``points``, or ``build`` returned something else than a Fit.
        Exception: whatever the uninterrupted reference fit raised (the set-up itself fails).
    """
    report = run_harness(Job(build, epochs, seed), points, seed, runs_root, workers, None, epochs)
    assert isinstance(report, CrashReport)
    return report


def fault_test(build: Build, *, epochs: int, faults: Sequence[str] = ("ENOSPC", "EIO"), points: Points = None,
               seed: int = 0, runs_root: str | Path | None = None, workers: int | None = None) -> FaultReport:
    """Fail each chosen persistence step of a fresh fit once with each errno of ``faults``.

    The points are those of :func:`crash_test` that write (every durable file write step --
    write, fsync, rename, directory fsync -- and every synced commit of the log), failing
    before the step. At each: the fit ends in an error naming the errno's text; the
    committed view is the reference's at the same LAST, whose checkpoint verifies; no
    temporary file is left; the audit holds; the run resumes to the reference's final state
    bitwise (or, with nothing committed yet, the resume is refused). Arguments as for
    :func:`crash_test`; ``points`` counts persistence points (each tried with every errno).

    Returns:
        a :class:`~nnx_es.testing.report.FaultReport`.
    """
    report = run_harness(Job(build, epochs, seed), points, seed, runs_root, workers, tuple(faults), epochs)
    assert isinstance(report, FaultReport)
    return report
