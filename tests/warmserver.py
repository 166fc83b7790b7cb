"""The warm process of tests/warmkit.py (started by ``warmkit.Warm``), its children, and the shims that
hand it a shell's command.

``python tests/warmserver.py`` imports :data:`PRELOAD`, says ``ready <socket>``, then serves: one job a
line on stdin (forked; ``pid N``, then ``rc N``), and any number of shims on its unix socket (each
connection forked, its command forked from that child with the shim's descriptors). Only the standard
library is imported at the top: a shim (``python -S``) imports this module too.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import io
import json
import os
import select
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: what the warm process imports once (a child imports them again for free); names absent are skipped
PRELOAD = ("torch", "numpy", "sklearn.datasets", "matplotlib.pyplot", "torch.utils.data", "nnx_es.trainer",
           "nnx_es.nnmodel", "nnx_es.testing", "nnx_es.cli.main", "nnx_es.cli.replay", "nnx_es.cli.inspect")

REPO = Path(__file__).resolve().parents[1]


def entry_point(script: str) -> str:
    """``module:function`` of the installed console script ``script`` (pyproject's [project.scripts])."""
    from importlib.metadata import entry_points

    found = [ep.value for ep in entry_points(group="console_scripts") if ep.name == script]
    if not found:
        raise LookupError(f"no console script {script!r} installed")
    return found[0]


# --- the console scripts of a shell (a docs page's shell blocks) ----------------------------------------

#: the environment variable naming the warm process's socket, for :func:`shim`
SOCKET_VAR = "NNX_ES_WARM_SOCKET"


def shim(script: str) -> None:
    """``script`` as a shell runs it (``nnx-es ...`` in a docs page's shell block), in a child of the warm process.

    This process (``python -S``: no site-packages, no torch) hands its argv, working directory, environment,
    process group and stdin/stdout/stderr (the descriptors themselves) to the warm process at
    :data:`SOCKET_VAR` (one of several, separated by ``os.pathsep``: the one of index ``RANK`` modulo
    their number), forwards SIGTERM/SIGINT/SIGHUP to the command, and ends as it ended: its exit status,
    or killed by the same signal (``|| echo "killed: exit $?"`` says 137). Without a warm process it execs
    the installed script."""
    import signal
    import socket

    paths = os.environ.get(SOCKET_VAR, "").split(os.pathsep)  # several: a torchrun rank takes its rank's
    rank = os.environ.get("RANK", "0")
    path = paths[int(rank) % len(paths) if rank.isdigit() else 0]
    args = sys.argv[1:]
    if script == "python":  # python [-u] SCRIPT ARGS, nothing else: -u is PYTHONUNBUFFERED
        while args[:1] == ["-u"]:
            os.environ["PYTHONUNBUFFERED"] = "1"
            args = args[1:]
        if not args or args[0].startswith("-") or not os.path.isfile(args[0]):
            path = ""
    if not path or not os.path.exists(path):
        real = sys.executable if script == "python" else os.path.join(os.path.dirname(sys.executable), script)
        os.execv(real, [real, *sys.argv[1:]])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    data = json.dumps({"script": script, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
                       "pgid": os.getpgrp()}).encode()
    socket.send_fds(conn, [len(data).to_bytes(8, "big") + data], [0, 1, 2])
    replies = conn.makefile("rb")
    pid = int(replies.readline().split()[1])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda n, _frame: os.kill(pid, n))
    line = replies.readline()
    rc = int(line.split()[1]) if line else 1
    if rc < 0:
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


def write_shims(directory: Path, scripts: Sequence[str] = ("nnx-es",), python: str = sys.executable) -> Path:
    """Write :func:`shim` scripts named ``scripts`` into ``directory`` (put it first on a shell's ``PATH``,
    with :data:`SOCKET_VAR` naming :attr:`Warm.socket`); return it."""
    directory.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    for script in scripts:
        path = directory / script
        path.write_text(f"#!{python} -S\nimport sys\nsys.path.insert(0, {here!r})\nfrom warmserver import shim\n"
                        f"shim({script!r})\n")
        path.chmod(0o755)
    return directory


# --- the warm process and its children ---------------------------------------------------------------


def _serve() -> int:
    """The warm process: one request a line on stdin, one connection at a time on its socket (a :func:`shim`);
    a child forked for each. Waits in ``select``; SIGCHLD wakes it."""
    import signal
    import socket

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    sock_dir = tempfile.mkdtemp(prefix="nnx-warm-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(sock_dir, "socket"))
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout.buffer
    out.write(f"ready {listener.getsockname()}\n".encode())
    out.flush()
    buffer, current, reading = b"", None, True

    def fork(serve: Any) -> int:
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            listener.close()
            serve()  # never returns
        return pid

    try:
        while reading or current is not None:
            fds = [listener.fileno(), wake_r] + ([0] if reading and current is None else [])
            ready = select.select(fds, [], [])[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
            if listener.fileno() in ready:
                conn, _ = listener.accept()
                fork(lambda: _connection(conn))
                conn.close()
            if 0 in ready:
                chunk = os.read(0, 65536)
                buffer += chunk
                reading = bool(chunk)
                if b"\n" in buffer:
                    line, _, buffer = buffer.partition(b"\n")
                    request = json.loads(line)
                    current = fork(lambda: _child(request))
                    out.write(f"pid {current}\n".encode())
                    out.flush()
            while True:  # reap: the stdin job's status goes back to the client
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == current:
                    out.write(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
                    out.flush()
                    current = None
    finally:
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return 0


def _connection(conn: Any) -> None:
    """A :func:`shim`'s connection (in a child of the warm process): run its command in a child with the
    shim's descriptors and process group, say ``pid N``, then ``rc N``; a shim gone first takes the command along,
    and so does the warm process's end (a rank of a launch killed at its timeout, hanging: torchrun starts each
    rank's shim in a session of its own, which the launch's kill does not reach)."""
    import socket

    rc, warm = 0, os.getppid()
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        size = int.from_bytes(data[:8], "big")
        data = data[8:]
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise EOFError("the shim went away")
            data += chunk
        for fd in (0, 1):  # the warm process's request and reply pipes: not this child's to hold
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
        asked = json.loads(data)
        script, args, cwd = asked["script"], asked["args"], asked["cwd"]
        request = {"cwd": cwd, "env": asked["env"], "pgid": asked["pgid"], "fds": fds}
        if script == "python":
            request.update(job="script:", args=args, path0=os.path.dirname(os.path.abspath(os.path.join(cwd, args[0]))))
        else:
            bin_dir = os.path.dirname(sys.executable)
            request.update(job=f"console:{entry_point(script)}", args=[os.path.join(bin_dir, script), *args],
                           path0=bin_dir)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())
                break
            if select.select([conn], [], [], 0.2)[0] and not conn.recv(1):  # the shim died: so does its command
                os.kill(pid, 9)
            elif os.getppid() != warm:  # the warm process has ended (the session is over): a command left is a leak
                os.kill(pid, 9)
    except BaseException:  # noqa: BLE001 - said on the warm process's stderr; the shim sees its end
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        os._exit(rc)


def _child(request: dict[str, Any]) -> None:
    rc = 1
    try:
        if request.get("pgid") is not None:  # a shim's command: in the shell's process group, killed with it
            try:
                os.setpgid(0, request["pgid"])
            except OSError:
                os.setpgid(0, 0)
        else:
            os.setpgid(0, 0)
        os.chdir(request["cwd"])
        if request["env"] is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        if request.get("fds") is not None:
            _stdio_fds(*request["fds"])
        else:
            _stdio(request["stdin"], request["stdout"], request["stderr"])
        _start_as_fresh(request["path0"])
        rc = _exit_status(_job(request["job"], request["args"]))
    except SystemExit as exc:
        rc = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - as an interpreter ends on an uncaught exception
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        try:
            atexit._run_exitfuncs()  # as an interpreter ends
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _stdio(stdin: str | None, stdout: str, stderr: str | None) -> None:
    """fds 0, 1, 2 on the request's files (``stderr`` None: ``stdout``'s)."""
    fd_in = os.open(stdin or os.devnull, os.O_RDONLY)
    fd_out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd_err = fd_out if stderr is None else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _stdio_fds(fd_in, fd_out, fd_err)


def _stdio_fds(fd_in: int, fd_out: int, fd_err: int) -> None:
    """fds 0, 1, 2 on these (closed here), and ``sys.std*`` new on them, as a fresh interpreter's."""
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
    for fd in {fd_in, fd_out, fd_err} - {0, 1, 2}:
        os.close(fd)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # python -u
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                                   line_buffering=True, write_through=unbuffered)


#: the warm process's sys.path past [0] and its own PYTHONPATH: the interpreter's and site's directories
_BASE_PATH: list[str] = []


def _start_as_fresh(path0: str) -> None:
    """``sys.path`` as a fresh interpreter builds it from this environment (``path0``, ``PYTHONPATH``, then the
    interpreter's own), and what preloaded modules read from the environment when imported, now that it is known."""
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [path0, *extra, *(p for p in _BASE_PATH if p not in extra)]
    if "numpy" in sys.modules:  # its global RandomState is seeded from the OS when imported: each new interpreter's differs
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "nnx_es.runtime.session" in sys.modules:  # it installs NNX_ES_KILL_AT's point when imported
        from nnx_es.injection import ENV_VAR, install_from_environment

        if os.environ.get(ENV_VAR):
            install_from_environment()


def _job(job: str, args: list[str]) -> object:
    import types

    kind, _, target = job.partition(":")
    main = types.ModuleType("__main__")  # the job's own __main__, never the warm process's (this module)
    sys.modules["__main__"] = main
    if kind == "console":  # a console script: sys.exit(main()) with sys.argv = [script, *args]
        module, _, name = target.partition(":")
        sys.argv = list(args)
        main.__file__ = args[0]
        return getattr(importlib.import_module(module), name)()
    if kind == "script":  # python SCRIPT ARGS
        import runpy

        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")
        return None
    if kind == "c":  # python -c CODE ARGS
        sys.argv = ["-c", *args[1:]]
        exec(compile(args[0], "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own code
        return None
    if kind == "file":
        path, _, name = target.rpartition(":")
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return getattr(module, name)(args)
    raise ValueError(f"unknown job {job!r}")


def _exit_status(code: object) -> int:
    """``sys.exit(code)``'s status: None 0, an int itself, anything else printed to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path[1:] if os.path.abspath(p or ".") not in own]
    sys.path[0] = str(REPO)  # the warm process is not a script of tests/: the repository's packages, as PYTHONPATH gives
    sys.exit(_serve())
