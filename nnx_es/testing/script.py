"""Crash tests of a script that calls ``fit`` itself: ``nnx-es crashtest train.py [--points N]``.

The script runs as ``__main__`` (its arguments in ``sys.argv``, its directory first on
``sys.path`` as ``python train.py`` puts it, the working directory the command's), with every
``Trainer`` it builds pointed at the harness's runs root and run id (``runs_root=``/``run_id=``
replaced, so ``NNModel.train`` is covered too); a resume runs it again with ``resume_from=`` added
to its ``fit``. The script is a job of :func:`nnx_es.testing.harness.run_harness`, as a ``build``
is for :func:`~nnx_es.testing.crash_test`: the uninterrupted reference run counts the points in
this process, which has imported torch and the runtime once; each point runs in a process forked
from it, killed there (:func:`nnx_es.injection.install_kill`), checked and resumed the same way
(:class:`~nnx_es.testing.reference.Reference`). Modules the script imports stay imported between
its runs in one process, as they do between the ``build`` calls of the API.

The script must train one run (one ``fit``) and be deterministic given its own seeds.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from nnx_es.errors import NnxError, ResumeError
from nnx_es.testing.harness import RUN_ID, Points, run_harness
from nnx_es.testing.report import CrashReport

__all__ = ["ScriptError", "ScriptJob", "crashtest_script", "drive", "run_script"]

class ScriptError(NnxError, RuntimeError):
    """The script's run failed: it raised, exited non-zero, or ran no ``fit`` (the error named)."""


def run_script(mode: str, runs: Path, argv: list[str]) -> dict[str, Any]:
    """Run the script ``argv[0]`` (arguments ``argv[1:]``) as ``__main__`` in this process, its
    trainers writing ``runs/<RUN_ID>``; ``mode``: ``"fresh"``, ``"resume"`` (``resume_from=``
    added to its ``fit``) or ``"reference"`` (fresh, and the persistence steps recorded).

    Returns ``{"status": <the fit's status or None>, "error": "<type>: <message>"}`` (no
    ``"error"`` when the script ended normally), plus the recording in ``"reference"`` mode.
    ``Trainer``, ``sys.argv`` and ``sys.path`` are as they were afterwards.
    """
    from nnx_es import Trainer, injection

    init, fit = Trainer.__init__, Trainer.fit
    seen: dict[str, Any] = {}

    @functools.wraps(init)  # the signature stays the Trainer's (NNModel.train reads its keywords from it)
    def patched_init(self: Trainer, *args: Any, **kwargs: Any) -> None:
        kwargs.update(runs_root=runs, run_id=RUN_ID)
        init(self, *args, **kwargs)

    @functools.wraps(fit)
    def patched_fit(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if mode == "resume":
            kwargs["resume_from"] = runs / RUN_ID
        result = fit(self, *args, **kwargs)
        seen["status"] = result.status
        return result

    report: dict[str, Any] = {}
    saved_argv, saved_path = sys.argv, list(sys.path)
    here = [str(Path(argv[0]).resolve().parent), os.getcwd()]  # as `python SCRIPT` (and the old driver) saw it
    Trainer.__init__ = patched_init  # type: ignore[method-assign]
    Trainer.fit = patched_fit  # type: ignore[method-assign]
    rec = injection.record_persistence() if mode == "reference" else None
    sys.argv = list(argv)
    sys.path[:0] = [p for p in dict.fromkeys(here) if p not in sys.path]
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            report["error"] = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Trainer.__init__, Trainer.fit = init, fit  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path
        if rec is not None:
            injection.uninstall()
    report["status"] = seen.get("status")
    if rec is not None:
        report.update(storage_ops=rec.storage_ops, storage_at=rec.storage_at, sync_at=rec.sync_at)
    return report


def drive(mode: str, runs: Path, out: Path, argv: list[str]) -> None:
    """:func:`run_script`, its result written to ``out`` (JSON): for a traced interpreter."""
    out.write_text(json.dumps(run_script(mode, runs, argv)))


class ScriptJob:
    """The script as a job of :func:`~nnx_es.testing.harness.run_harness` (and of the power-loss
    harness): ``fit(runs, resume)`` runs it in this process."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)

    def fit(self, runs: Path, resume: bool = False) -> Any:
        """Run the script fresh (or resuming ``runs/<RUN_ID>``); return an object with its fit's ``status``.

        Raises:
            ResumeError: the resume was refused (the script's fit raised it).
            ScriptError: the script failed otherwise, or ran no ``fit``.
        """
        got = run_script("resume" if resume else "fresh", runs, self.argv)
        error = str(got.get("error") or "")
        if error.startswith("ResumeError"):
            raise ResumeError(error)
        if error or got.get("status") is None:
            raise ScriptError(f"{self.argv[0]} failed: {error or 'it ran no fit'}")
        return type("ScriptResult", (), {"status": got["status"]})()


def crashtest_script(argv: list[str], *, points: Points = None, seed: int = 0,
                     jobs: int = 2) -> CrashReport:
    """Crash-test the script ``argv[0]`` (with arguments ``argv[1:]``): :func:`~nnx_es.testing.crash_test`'s
    checks, each point in a process forked from this one. ``points``: ``N`` sampled with ``seed``,
    or ``"all"``/``None``; ``jobs``: forked workers.

    Raises:
        ScriptError: the uninterrupted reference run of the script failed (its error named).
        ConfigError: a bad ``points``.
    """
    try:
        report = run_harness(ScriptJob(argv), points, seed, None, max(1, jobs))
    except ScriptError as exc:
        raise ScriptError(f"the reference run of {exc}") from None
    assert isinstance(report, CrashReport)
    return report
