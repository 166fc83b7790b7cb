"""Power-loss tests of a user's training set-up: the states a power cut may leave, each checked.

    report = power_loss_test(build, epochs=3, states=300)
    assert report.ok, report

A SIGKILL (:func:`~nnx_es.testing.crash_test`) leaves the page cache alone, so every write the
process made still reaches the disk; a power cut keeps only what was synced, in an order the
file system chooses. This test:

1. runs ``build``'s fit once, uninterrupted, in a fresh interpreter with the tracing shim
   (:mod:`nnx_es.testing.tracer`; ``LD_PRELOAD`` is read at exec) -- the *traced run*, which is
   also the reference;
2. replays its trace into the states a cut after each persistence point may leave
   (:mod:`nnx_es.testing.crashstates`, a seeded, bounded sample; ext4 ``data=ordered``);
3. checks every state in a process forked from this warm one (never a new interpreter): reading
   it never kills the process (a check that dies by a signal -- SIGABRT from an LMDB assertion,
   SIGBUS from a truncated map -- is a violation); the log is a prefix of the reference's and
   the audit (:func:`nnx_es.audit.audit_run`) reports it clean, an uncommitted tail aside; the
   committed view -- what readers show, :func:`nnx_es.rows.read_rows` included -- is the
   reference's at the state's LAST, never an epoch past it; that LAST is no older than the
   newest one whose synced commit had returned before the cut (nothing committed is lost); and a
   resume (``resume_from=``) ends bitwise equal to the reference
   (:class:`~nnx_es.testing.reference.Reference`), or, with nothing committed, is refused.

The traced interpreter must rebuild ``build``: it is imported by module and qualified name, as
``multiprocessing``'s spawn does (a ``__main__`` script by its path, run as ``__mp_main__``), so
it must be a module-level function. POSIX and a C compiler only (the shim is built on first use).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnx_es.errors import ConfigError, NnxError
from nnx_es.injection import mark_kills_expected
from nnx_es.testing.crashstates import CrashState, crash_states, persistence_points
from nnx_es.testing.harness import RUN_ID, Build, Job, read_until_exit, resume_and_check, seed_globals, work_root
from nnx_es.testing.reference import Finding, Reference
from nnx_es.testing.report import Failure, PowerLossReport
from nnx_es.testing.tracer import TRACE_ROOT_VAR, build_shim, install_commit_markers, read_trace, traced_env

__all__ = ["power_loss_test", "powerloss_script"]


def _locate(build: Build) -> tuple[str, str, str]:
    """``(module, qualname, script path or "")`` of a module-level ``build``.

    Raises:
        ConfigError: ``build`` is a lambda, a nested function, a bound method or an object that its
            module does not hold under its name (the traced interpreter could not rebuild it).
    """
    module, qualname = getattr(build, "__module__", None), getattr(build, "__qualname__", None)
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise ConfigError(f"power_loss_test rebuilds build in a fresh interpreter and needs a module-level function "
                          f"(as multiprocessing's spawn does), got {build!r}: define it at the top level of a module")
    script = ""
    holder = sys.modules.get(module)
    if module == "__main__":
        script = getattr(holder, "__file__", None) or ""
        if not script:
            raise ConfigError(f"build {qualname!r} is defined in an interactive __main__ with no file: move it to a "
                              "module the traced interpreter can import")
    elif getattr(holder, qualname, None) is not build:
        raise ConfigError(f"build {module}.{qualname} is not what its module holds under that name: pass a "
                          "module-level function")
    return module, qualname, script


def _load(module: str, qualname: str, script: str) -> Build:
    """``build`` as the traced interpreter finds it: the script run as ``__mp_main__``, or the module.

    Raises:
        ConfigError: the script or module does not define it at its top level (in a script, defined
            under ``if __name__ == "__main__":`` or in a branch the import does not run).
    """
    if script:
        found = runpy.run_path(script, run_name="__mp_main__").get(qualname)
        where = f"the script {script} (run as __mp_main__, as multiprocessing's spawn runs it)"
    else:
        found = getattr(importlib.import_module(module), qualname, None)
        where = f"the module {module}"
    if found is None:
        raise ConfigError(f"build {qualname!r} is not defined when the traced interpreter imports {where}: define it "
                          "at the top level, not under `if __name__ == \"__main__\":` or in a branch")
    return found  # type: ignore[no-any-return]


def _traced_run(command: list[str], runs: Path, trace: Path) -> None:
    """Run :func:`_main` with ``command`` in a fresh interpreter, traced under ``runs``.

    Raises:
        ConfigError: the traced interpreter could not find or rebuild ``build`` (its message).
        RuntimeError: the traced run failed (its stderr's end named).
    """
    runs.mkdir(parents=True, exist_ok=True)
    env = traced_env(build_shim(), trace, runs)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)  # where build's module was found
    # not ``-m``: the package imports this module first, and runpy would warn on every traced run
    entry = "import sys; from nnx_es.testing.powerloss import _main; _main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", entry, *command], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().rpartition("\n")[2]
        if last.startswith("nnx_es.errors.ConfigError: "):  # build cannot be found or rebuilt: say so, not a traceback
            raise ConfigError(last.removeprefix("nnx_es.errors.ConfigError: "))
        raise RuntimeError(f"the traced reference run failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


# --- the checks of one state (in a forked child) ---------------------------------------------


def _check_state(state: CrashState, ref: Reference, runs: Path, resume: Callable[[], Any]) -> str:
    from events.schema import LastCommitted
    from nnx_es.rows import read_rows

    state.write(runs)
    run_dir = runs / RUN_ID
    required = sum(1 for seq, e in ref.events[:state.committed_events] if isinstance(e, LastCommitted))
    if not (run_dir / "events.lmdb" / "data.mdb").exists():
        if required:
            raise Finding("nothing committed is lost", f"LAST #{required} (its commit had returned)", "no event log")
        return resume_and_check(resume, ref, runs, 0, refusals=(NnxError,))
    try:
        events = ref.check_prefix(run_dir)
    except Finding:
        raise
    except Exception as exc:  # noqa: BLE001 - named in the finding
        if required or not isinstance(exc, NnxError):
            raise Finding("the log reads back (nothing is unreadable)", "the events written before the cut",
                          f"{type(exc).__name__}: {exc}"[:500]) from None
        try:  # nothing committed yet: a clear refusal to read is fine, and the resume must be refused
            resume()
        except NnxError:  # ResumeError, or the log's own clear error (EventLogError naming the damage)
            return "refused"
        raise Finding("a resume before any LAST commit is refused", "ResumeError", "the resume ran") from None
    k = ref.check_committed(run_dir, events)
    if k < required:
        raise Finding("nothing committed is lost: the newest LAST whose commit returned before the cut is still LAST",
                      f"LAST #{required} ({state.committed_events} events durable)", f"LAST #{k} ({len(events)} events)")
    if k:
        epochs = ref.at_last[k - 1]["last"].epoch if ref.at_last[k - 1]["last"] else -1
        shown = read_rows(run_dir).epochs
        if shown and shown[-1] > epochs:
            raise Finding("readers never show an epoch beyond the durable LAST", f"epochs <= {epochs}",
                          f"read_rows shows epoch {shown[-1]}")
    # with nothing committed, a log the cut left unreadable may be refused by its own clear error
    return resume_and_check(resume, ref, runs, k, refusals=(NnxError,))


def state_name(state: CrashState) -> str:
    """``state <point>.<digest prefix>``: how a report names a crash state."""
    return f"state {state.point}.{state.digest[:8]}"


def _in_child(state: CrashState, ref: Reference, runs: Path, resume: Callable[[], Any],
              keep: Path | None = None) -> tuple[str, dict | None]:
    """Check ``state`` in a forked child; a child dying by a signal is a violation. With ``keep``, a
    state that fails is written again to ``keep/<name>`` (as the cut left it, before any resume)."""
    where = f"a cut after persistence point {state.point} ({state.where}), {state.committed_events} events committed"
    name = state_name(state)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        mark_kills_expected()
        quiet = os.open(os.devnull, os.O_WRONLY)  # the resumes' own logging: the report says what matters
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        sys.stdout = sys.stderr = open(quiet, "w")  # noqa: SIM115 - the child exits with os._exit
        try:
            try:
                result: dict[str, Any] = {"outcome": _check_state(state, ref, runs, resume)}
            except Finding as f:
                result = {"outcome": "failed", "check": f.check, "expected": f.expected, "found": f.found,
                          "divergence": f.divergence}
            except BaseException as exc:  # noqa: BLE001 - a surprise is a violation of the state too
                result = {"outcome": "failed", "check": "the state can be read and resumed without an error",
                          "expected": "no error", "found": f"{type(exc).__name__}: {exc}"[:500]}
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    data, status = read_until_exit(pid, r)
    shutil.rmtree(runs, ignore_errors=True)
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        if keep is not None:
            state.write(keep / name.replace(" ", "_"))
        return "failed", {"point": name, "where": where, "check": "nothing is unreadable: reading the state never "
                          "kills the process", "expected": "the checks to finish", "found": f"the check died by {sig}"}
    if not data:
        return "failed", {"point": name, "where": where, "check": "the state can be checked",
                          "expected": "a report from its child", "found": f"wait status {status}"}
    result = json.loads(data)
    outcome = result.pop("outcome")
    if outcome != "failed":
        return outcome, None
    if keep is not None:
        state.write(keep / name.replace(" ", "_"))
    return outcome, {"point": name, "where": where, **result}


def _explore(ops: list, traced_root: Path, ref: Reference, work: Path, resume: Callable[[Path], Callable[[], Any]],
             per_point: int, seed: int, workers: int,
             keep: Path | None) -> tuple[dict[str, str], list[Failure], list[int]]:
    """Check every state in ``workers`` forked workers (each draws the same states, checks its share)."""
    children = []
    for i in range(workers):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                results = []
                for n, state in enumerate(crash_states(ops, str(traced_root), per_point=per_point, seed=seed)):
                    if n % workers == i:
                        runs = work / f"w{i}"
                        results.append((n, state.point, state_name(state),
                                        *_in_child(state, ref, runs, resume(runs), keep)))
                with os.fdopen(w, "wb") as f:
                    f.write(json.dumps(results).encode())
            finally:
                os._exit(0)
        os.close(w)
        children.append((pid, r))
    rows: list[tuple[int, int, str, str, dict | None]] = []
    for pid, r in children:
        data, status = read_until_exit(pid, r)
        if not data:
            raise RuntimeError(f"a power-loss worker died (wait status {status})")
        rows += [tuple(x) for x in json.loads(data)]  # type: ignore[misc]
    rows.sort(key=lambda x: x[0])
    outcomes = {name: o for _, _, name, o, _ in rows}
    failures = [Failure(**f) for *_, f in rows if f is not None]
    return outcomes, failures, [p for _, p, *_ in rows]


def _warm_up(resume: Callable[[Path], Callable[..., Any]], ref: Reference, runs: Path) -> None:
    """Warm this process, then check in a forked child that ``build``'s fit reproduces the traced run.

    The forked checks start from this process: a fit of a tiny model here first pays torch's and
    the runtime's one-time costs (``torch._dynamo`` is imported by the first optimizer: seconds).
    ``build`` itself runs only in children, so what it patches (a planted bug) stays out of this
    process. A set-up that does not reproduce across processes would fail every state.

    Raises:
        RuntimeError: the fit differs from the traced run (the first difference named).
    """
    import torch
    from torch import nn

    from nnx_es import Trainer
    from nnx_es.testing.harness import run_in_child

    net = nn.Linear(2, 2)
    x = torch.zeros(4, 2)
    Trainer(net, torch.optim.Adam(net.parameters()), nn.CrossEntropyLoss(), runs_root=runs, run_id="warm",
            progress=False).fit([(x, torch.zeros(4, dtype=torch.long))], epochs=1)
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)

    def fit_and_compare() -> None:
        result = resume(runs)(fresh=True)
        ref.check_resumed(runs / RUN_ID, result.status)

    outcome = run_in_child(fit_and_compare)
    shutil.rmtree(runs, ignore_errors=True)
    if outcome != "completed":
        raise RuntimeError(f"the set-up does not reproduce across processes: a fit forked from this process differs "
                           f"from the traced one ({outcome.removeprefix('error: ')}); seed every source of "
                           "randomness in build")


def _harness(command: list[str], resume: Callable[[Path], Callable[[], Any]], epochs: int | None, states: int,
             seed: int, runs_root: str | Path | None, workers: int | None,
             keep_failed: str | Path | None = None) -> PowerLossReport:
    import torch

    if isinstance(states, bool) or not isinstance(states, int) or states < 1:
        raise ConfigError(f"states must be an int >= 1, got {states!r}")
    t0 = time.perf_counter()
    root, owned = work_root(runs_root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # forked children must not inherit a busy intra-op pool
    try:
        traced = (root / "traced").resolve()
        _traced_run(command, traced, root / "trace.bin")
        ops = read_trace(root / "trace.bin")
        ref = Reference.of(traced / RUN_ID)
        _warm_up(resume, ref, root / "warm")
        points = len(persistence_points(ops, str(traced))) + 1
        per_point = max(2, math.ceil(states / points))
        n_workers = workers if workers is not None else max(1, min(2, os.cpu_count() or 1))
        keep = Path(keep_failed) if keep_failed is not None else None
        outcomes, failures, at = _explore(ops, traced, ref, root / "states", resume, per_point, seed, n_workers, keep)
    finally:
        torch.set_num_threads(threads)
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    return PowerLossReport(epochs=epochs or len(ref.history), available=points, tried=tuple(outcomes),
                           outcomes=outcomes, failures=tuple(failures), elapsed_s=time.perf_counter() - t0,
                           points_with_states=len(set(at)))


def power_loss_test(build: Build, *, epochs: int, states: int = 300, seed: int = 0,
                    runs_root: str | Path | None = None, workers: int | None = None,
                    keep_failed: str | Path | None = None) -> PowerLossReport:
    """Check the states a power cut may leave at every persistence point of ``build``'s fit.

    Args:
        build: ``build(runs_root, run_id) -> Fit`` as for :func:`~nnx_es.testing.crash_test`, and a
            module-level function (the traced interpreter imports it by module and name; a script's
            is found by running the script as ``__mp_main__``, so call this under
            ``if __name__ == "__main__":`` there, as ``multiprocessing`` asks).
        epochs: the fit's ``epochs``.
        states: the budget of crash states, spread evenly over the persistence points (at least 2
            per point: nothing unsynced kept, everything kept); identical states are checked once.
        seed: seeds the global RNGs before every ``build`` call, and the draw of the states.
        runs_root / workers: as for :func:`~nnx_es.testing.crash_test`.
        keep_failed: a directory to write each failing state to, as the cut left it
            (``<keep_failed>/state_<point>.<digest>/crashtest/...``: open it with ``tools/replay``).

    Returns:
        a :class:`~nnx_es.testing.report.PowerLossReport` (``assert report.ok, report``).

    Raises:
        ConfigError: ``build`` is not a module-level function (or, in a script, is defined under
            ``if __name__ == "__main__":``), this call runs at the import of build's script (no such
            guard around it), or bad ``epochs`` / ``states``.
        NoCompilerError: no C compiler to build the tracing shim.
        RuntimeError: the traced reference run failed (its error named).
    """
    if os.environ.get(TRACE_ROOT_VAR):
        raise ConfigError("power_loss_test was called inside its own traced interpreter: that interpreter imports "
                          "build's script to find build, and the script calls power_loss_test at import; call it "
                          "under `if __name__ == \"__main__\":`, as multiprocessing asks")
    module, qualname, script = _locate(build)
    job = Job(build, epochs, seed)
    return _harness(["build", module, qualname, script, str(epochs), str(seed)],
                    lambda runs: lambda fresh=False: job.fit(runs, resume=not fresh), epochs, states, seed, runs_root,
                    workers, keep_failed)


def powerloss_script(argv: list[str], *, states: int = 300, seed: int = 0, jobs: int = 2) -> PowerLossReport:
    """:func:`power_loss_test` of the script ``argv[0]`` (arguments ``argv[1:]``), which calls ``fit``
    itself (as ``nnx-es crashtest``, :mod:`nnx_es.testing.script`); each resume runs the script again,
    in a child forked from this process.

    Raises:
        RuntimeError: the traced run of the script failed.
    """
    from nnx_es.testing.script import ScriptJob

    job = ScriptJob(argv)

    def resume(runs: Path) -> Callable[..., Any]:
        def run(fresh: bool = False) -> Any:
            seed_globals(seed)  # as the traced interpreter did: a forked child's global RNGs are this process's
            return job.fit(runs, resume=not fresh)
        return run

    return _harness(["script", str(seed), *argv], resume, None, states, seed, None, jobs)


def _main(argv: list[str]) -> None:
    """The traced interpreter: ``build <module> <qualname> <script> <epochs> <seed> <runs>`` or
    ``script <seed> <script argv...>`` (the runs root comes from the tracer's environment; the
    global RNGs are seeded with ``seed`` before the script runs, as before each resume)."""
    import torch

    torch.set_num_threads(1)
    install_commit_markers()
    runs = Path(os.environ[TRACE_ROOT_VAR])
    if argv[0] == "build":
        module, qualname, script, epochs, seed = argv[1:6]
        Job(_load(module, qualname, script), int(epochs), int(seed)).fit(runs)
    else:
        from nnx_es.testing.script import drive

        out = runs.parent / "traced.json"
        seed_globals(int(argv[1]))
        drive("reference", runs, out, argv[2:])
        error = json.loads(out.read_text()).get("error")
        if error:
            raise SystemExit(f"the script failed: {error}")


if __name__ == "__main__":
    _main(sys.argv[1:])
