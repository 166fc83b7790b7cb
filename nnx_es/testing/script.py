"""Crash tests of a script that calls ``fit`` itself: ``nnx-es crashtest train.py [--points N]``.

Each run of the script is a process of its own (``python -m nnx_es.testing.script``, the
*driver*), which runs the script as ``__main__`` with every ``Trainer`` it builds pointed at
the harness's runs root and run id (``runs_root=``/``run_id=`` replaced, so ``NNModel.train``
is covered too). The reference run counts the points (:mod:`nnx_es.injection`); each killed
run gets ``NNX_ES_KILL_AT=<point>`` in its environment, which the runtime reads once when it
is imported and which does nothing but SIGKILL the process there; each resume runs the
script again with ``resume_from=`` added to its ``fit``. The checks are those of
:func:`nnx_es.testing.crash_test` (:class:`~nnx_es.testing.reference.Reference`).

The script must train one run (one ``fit``) and be deterministic given its own seeds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nnx_es.injection import ENV_VAR, Recording, parse_point
from nnx_es.testing.harness import RUN_ID, choose_points, Site, persistence_sites
from nnx_es.testing.reference import Finding, Reference, read_log
from nnx_es.testing.report import CrashReport, Failure

__all__ = ["crashtest_script", "drive"]


def drive(mode: str, runs: Path, out: Path, argv: list[str]) -> None:
    """Run the script ``argv[0]`` (arguments ``argv[1:]``) as ``__main__`` in this process, its
    trainers writing ``runs/<RUN_ID>``; write what the harness needs to ``out`` (JSON)."""
    from nnx_es import injection
    from nnx_es import Trainer

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

    Trainer.__init__ = patched_init  # type: ignore[method-assign]
    Trainer.fit = patched_fit  # type: ignore[method-assign]
    rec = injection.record_persistence() if mode == "reference" else None
    report: dict[str, Any] = {}
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            report["error"] = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["status"] = seen.get("status")
    if rec is not None:
        report.update(storage_ops=rec.storage_ops, storage_at=rec.storage_at, sync_at=rec.sync_at)
    out.write_text(json.dumps(report))


def _run_driver(mode: str, runs: Path, argv: list[str], point: str | None = None) -> tuple[int, dict[str, Any]]:
    out = runs.parent / f"{runs.name}.{mode}.json"
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if point is not None:
        env[ENV_VAR] = point
    proc = subprocess.run([sys.executable, "-m", "nnx_es.testing.script", mode, str(runs), str(out), *argv],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    report = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-2000:]}
    return proc.returncode, report


def _check_point(ref: Reference, root: Path, site: Site, argv: list[str]) -> tuple[str, Failure | None]:
    name = str(site.point)
    runs = root / name.replace(":", "_")
    run_dir = runs / RUN_ID
    try:
        code, got = _run_driver("kill", runs, argv, name)
        if code != -signal.SIGKILL:
            raise Finding("the script is killed at the point", "SIGKILL", got.get("error") or f"exit status {code}")
        k = ref.check_committed(run_dir, ref.check_prefix(run_dir))
        before = len(read_log(run_dir))
        code, got = _run_driver("resume", runs, argv)
        if k == 0:
            if not str(got.get("error", "")).startswith("ResumeError"):
                raise Finding("a resume before any LAST commit is refused", "ResumeError",
                              got.get("error") or "the resume ran")
            if len(read_log(run_dir)) != before:
                raise Finding("a refused resume writes nothing", f"{before} events", "more")
            return "refused", None
        if got.get("error") or got.get("status") is None:
            raise Finding("the run resumes from its LAST", "a completed resume", got.get("error") or "no fit ran")
        ref.check_resumed(run_dir, got["status"])
        return "resumed", None
    except Finding as f:
        return "failed", Failure(name, site.where, f.check, f.expected, f.found, f.divergence)
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def crashtest_script(argv: list[str], *, points: int | str | None = None, seed: int = 0, jobs: int = 2) -> CrashReport:
    """Crash-test the script ``argv[0]`` (with arguments ``argv[1:]``); one process per run.

    Raises:
        RuntimeError: the uninterrupted reference run of the script failed (its error named).
    """
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="nnx_es_crashtest_"))
    try:
        code, got = _run_driver("reference", root / "reference", argv)
        if code != 0 or got.get("error") or got.get("status") is None:
            raise RuntimeError(f"the reference run of {argv[0]} failed: {got.get('error') or f'exit status {code}'}"
                               + ("" if got.get("status") or got.get("error") else " (it ran no fit)"))
        ref = Reference.of(root / "reference" / RUN_ID)
        rec = Recording([tuple(op) for op in got["storage_ops"]], got["storage_at"], got["sync_at"])
        sites = persistence_sites(ref, rec, kills=True)
        chosen = choose_points(sites, points, seed)
        (root / "points").mkdir()
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(lambda s: _check_point(ref, root / "points", s, argv), chosen))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    names = tuple(str(s.point) for s in chosen)
    return CrashReport(epochs=len(ref.history), available=len(sites), tried=names,
                       outcomes={n: o for n, (o, _) in zip(names, results)},
                       failures=tuple(f for _, f in results if f is not None), elapsed_s=time.perf_counter() - t0)


def _main() -> None:
    ap = argparse.ArgumentParser(prog="python -m nnx_es.testing.script", description="(internal) one run of a script")
    ap.add_argument("mode", choices=("reference", "kill", "resume"))
    ap.add_argument("runs", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.mode == "kill":
        parse_point(os.environ.get(ENV_VAR, ""))  # refused loudly when missing
    drive(args.mode, args.runs, args.out, args.argv)


if __name__ == "__main__":
    _main()
