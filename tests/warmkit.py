"""A warm process that forks a child per job: commands and docs pages start with torch imported.

A fresh interpreter spends ~4 s of CPU importing torch before a command starts (several times that
in wall time on a loaded 2-core machine). The warm process (``tests/warmserver.py``, started by
:class:`Warm`) imports ``warmserver.PRELOAD`` once and never runs a tensor op itself, so a forked child
starts with no thread pool to inherit. It is a plain interpreter, not pytest's: no output capture,
warning filters, log handlers or threads of a test run reach the child.

One job at a time: the client writes a request (one JSON line: the job, its arguments, the working
directory, the environment, the files for stdin/stdout/stderr, ``sys.path[0]``); the warm process
forks, says ``pid N``, waits, and says ``rc N`` (``-N`` for a child killed by signal N, as
:mod:`subprocess` says). The child, in a process group of its own, starts as a fresh interpreter
would with that environment, runs the job and ends as one does (atexit handlers, stdio flushed, the
exit status).

Jobs: ``console`` runs a console script's function (``nnx-es`` is ``nnx_es.cli.main:main``, read from
the installed entry points) with ``sys.argv`` set, as the script does (:func:`command`); ``script`` runs a
file as ``python FILE`` does (:func:`python`); ``c`` runs code as ``python -c`` does (:func:`python_c`);
``file`` runs a function of a Python file (:func:`call`; the docs runner's ``tests/docs/snippets.py:run_page``).
A shell's command reaches the warm process through a shim on its ``PATH`` (``warmserver.shim``: a docs
page's ``nnx-es``, :meth:`Warm.shim_env`), a torchrun rank through the ``python`` shim
(:meth:`Warm.python_shim`, ``torchrun --no-python``).

What differs from a new interpreter, and why it does not matter here: modules are imported before
the environment is known. Those that read it at import are re-read at the start
(``OMP_NUM_THREADS`` -> torch's thread count; ``NNX_ES_KILL_AT``, which nnx_es.runtime.session
installs when imported; ``PYTHONPATH`` and ``PYTHONUNBUFFERED``); torch's C++ log level
(``TORCH_CPP_LOG_LEVEL``) stays the warm process's. NumPy's global random state, seeded from the OS at its
import, is seeded again in each child (Python's ``random`` reseeds itself after a fork). A child's string
hash seed is its warm process's: there are two warm processes (:func:`shared`), each with a hash seed of its
own, and two jobs in a row (:func:`command`, :func:`python`, ...) or two neighbouring torchrun ranks never
share one, so a result that depends on the order of a set is still seen to differ between two processes, as
between two new interpreters (``PYTHONHASHSEED`` set in the environment: every process has it, as
every new interpreter would). A module imported by the warm process stays the one
it found. A test of the console scripts themselves, of a fresh interpreter's imports or of an
environment read otherwise runs a real subprocess (``python -m nnx_es``, the installed script).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from warmserver import SOCKET_VAR, entry_point, write_shims

__all__ = ["REPO", "SOCKET_VAR", "Warm", "call", "close_shared", "command", "entry_point", "environment", "python",
           "python_c", "shared", "sockets"]

REPO = Path(__file__).resolve().parents[1]


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH`` (and ``extra``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


class Warm:
    """The client of one warm process (started here, with ``python``'s interpreter and ``env``)."""

    def __init__(self, python: str | Path = sys.executable, env: Mapping[str, str] | None = None,
                 hash_seed: int | None = None) -> None:
        env = dict(environment() if env is None else env)
        env.pop("OMP_NUM_THREADS", None)  # a child sets its own thread count from its environment
        if hash_seed is not None and "PYTHONHASHSEED" not in env:  # the children's string hash seed
            env["PYTHONHASHSEED"] = str(hash_seed)
        env["MPLBACKEND"] = env.get("MPLBACKEND", "Agg")
        self.python = str(python)
        self._proc = subprocess.Popen([self.python, str(Path(__file__).resolve().with_name("warmserver.py"))], env=env,
                                      cwd=tempfile.gettempdir(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      bufsize=0)
        self._buffer = b""
        ready = self._line(timeout_s=300)
        if ready is None or not ready.startswith("ready "):
            raise RuntimeError(f"the warm process did not start: {ready!r}")
        #: the warm process's socket, where a :func:`shim` hands it a shell's command
        self.socket = ready.split(" ", 1)[1]
        self._shims: Path | None = None

    def _shim_root(self) -> Path:
        if self._shims is None:
            self._shims = Path(tempfile.mkdtemp(prefix="nnx-shims-"))
            write_shims(self._shims / "bin", ("nnx-es",), python=self.python)
            write_shims(self._shims / "python", ("python",), python=self.python)
        return self._shims

    def shim_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for a shell whose ``nnx-es`` runs in a child of this warm process: a directory of
        :func:`shim` scripts first on ``PATH``, :data:`SOCKET_VAR` naming the socket."""
        shims = self._shim_root() / "bin"
        return {**env, "PATH": os.pathsep.join([str(shims), env.get("PATH", "")]), SOCKET_VAR: self.socket}

    def python_shim(self) -> Path:
        """An executable that runs ``[-u] SCRIPT ARGS`` as ``python`` would, in a child of this warm process
        (with :data:`SOCKET_VAR` in its environment; ``torchrun --no-python`` starts ranks with it)."""
        return self._shim_root() / "python" / "python"

    def _line(self, timeout_s: float) -> str | None:
        """The warm process's next line, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm process exited ({self._proc.wait()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def run(self, job: str, args: Sequence[str], *, cwd: str | Path, env: Mapping[str, str] | None,
            stdout: str | Path, stderr: str | Path | None = None, stdin: str | Path | None = None,
            path0: str | Path | None = None, timeout_s: float) -> int | None:
        """Run ``job`` (``console:<entry point>`` or ``file:<path>:<function>``) with ``args`` in a forked
        child; return its exit status (``-N``: killed by signal N), or None when it outran ``timeout_s``
        (its process group is then killed). ``stderr`` None: into ``stdout``'s file (``2>&1``).
        ``env`` None: the warm process's. ``path0``: ``sys.path[0]`` (default ``cwd``, as ``python -m``)."""
        request = {"job": job, "args": list(args), "cwd": str(cwd), "env": None if env is None else dict(env),
                   "stdout": str(stdout), "stderr": None if stderr is None else str(stderr),
                   "stdin": None if stdin is None else str(stdin), "path0": str(path0 if path0 is not None else cwd)}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]
        started = self._line(timeout_s=60)
        if started is None or not started.startswith("pid "):
            raise RuntimeError(f"the warm process did not start {job!r}: {started!r}")
        pid = int(started.split()[1])
        done = self._line(timeout_s)
        if done is None:
            try:
                os.killpg(pid, signal.SIGKILL)  # the child and whatever it started
            except ProcessLookupError:
                pass
            self._line(timeout_s=60)
            return None
        return int(done.split()[1])

    def close(self) -> None:
        """End the warm process: it exits when its stdin closes and its last job has ended (killed after 60 s)."""
        self._proc.stdin.close()  # type: ignore[union-attr]
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._shims is not None:
            shutil.rmtree(self._shims, ignore_errors=True)


_SHARED: dict[int, Warm] = {}
#: the two shared warm processes' string hash seeds: two different ones, drawn for this test process
_HASH_SEEDS = random.SystemRandom().sample(range(1, 2**32), 2)
_turn = itertools.count()


def shared(which: int = 0) -> Warm:
    """This test process's warm process ``which`` (0 or 1, each with a hash seed of its own), started on first
    use (both closed by tests/conftest.py at the session's end)."""
    if which not in _SHARED:
        _SHARED[which] = Warm(hash_seed=_HASH_SEEDS[which])
    return _SHARED[which]


def sockets() -> str:
    """Both shared warm processes' sockets for :data:`SOCKET_VAR` (a rank's shim takes the one of its rank's parity)."""
    return os.pathsep.join(shared(i).socket for i in (0, 1))


def close_shared() -> None:
    while _SHARED:
        _SHARED.popitem()[1].close()


# --- the commands, as their tests call them ----------------------------------------------------------


def command(script: str, *args: str, cwd: str | Path, env: Mapping[str, str] | None = None, input: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the console script ``script`` (``nnx-es``, ``nnx-replay``, ``nnx-inspect``) with ``args`` in ``cwd``,
    as ``subprocess.run(..., capture_output=True, text=True)`` would, in a child of the warm process.
    ``env`` defaults to :func:`environment`; a run past ``timeout`` seconds is killed and raises
    ``subprocess.TimeoutExpired`` (with what it wrote so far)."""
    bin_dir = Path(shared().python).parent  # sys.path[0] of an installed console script: its bin/
    return _captured(f"console:{entry_point(script)}", [script, *args], cwd=cwd, env=env, input=input, timeout=timeout,
                     path0=bin_dir)


def call(path: str | Path, function: str, *args: str, cwd: str | Path, env: Mapping[str, str] | None = None,
         input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``function(list(args))`` of the Python file ``path`` (imported in the child, under its stem's name)
    in a child of the warm process, as :func:`command` runs a script: its return value is the exit status."""
    return _captured(f"file:{Path(path).resolve()}:{function}", list(args), cwd=cwd, env=env, input=input,
                     timeout=timeout)


def python_c(code: str, *args: str, cwd: str | Path, env: Mapping[str, str] | None = None, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` in ``cwd``, as :func:`command` runs a script: ``CODE`` runs as ``__main__``
    with ``sys.argv == ["-c", *args]``; its exit status is ``sys.exit``'s (0 when it ends)."""
    return _captured("c:", [code, *args], cwd=cwd, env=env, input=input, timeout=timeout)


def python(script: str | Path, *args: str, cwd: str | Path, env: Mapping[str, str] | None = None,
           input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` in ``cwd``, as :func:`command` runs a console script: the script runs as
    ``__main__``, ``sys.path[0]`` its directory."""
    script = str(script)
    return _captured("script:", [script, *args], cwd=cwd, env=env, input=input, timeout=timeout,
                     path0=os.path.dirname(os.path.abspath(os.path.join(cwd, script))))


def _captured(job: str, args: list[str], *, cwd: str | Path, env: Mapping[str, str] | None, input: str | None,
              timeout: float, path0: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    warm = shared(next(_turn) % 2)  # two jobs in a row: two hash seeds, as two new interpreters
    with tempfile.TemporaryDirectory(prefix="nnx-warm-") as tmp:
        out, err, inp = Path(tmp) / "stdout", Path(tmp) / "stderr", None
        if input is not None:
            inp = Path(tmp) / "stdin"
            inp.write_text(input)
        rc = warm.run(job, args, cwd=cwd, env=environment() if env is None else env, stdout=out, stderr=err,
                      stdin=inp, path0=path0, timeout_s=timeout)
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    if rc is None:
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, rc, stdout, stderr)
