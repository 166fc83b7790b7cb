"""The recorder of a run's persistence operations, below Python: an ``LD_PRELOAD`` shim.

:func:`build_shim` compiles ``trace_shim.c`` (beside this module) with the system C compiler
into a cache directory keyed by the source's SHA-256, once; :func:`traced_env` gives the
environment that loads it into a new process (``LD_PRELOAD`` is read at exec, so the traced
process is a fresh interpreter); :func:`read_trace` reads the records back as :class:`Op`
values, in the order the shim serialised the calls. The shim sees LMDB's own writes from C
(py-lmdb's bundled LMDB 0.9 imports ``pwrite``, ``write``, ``writev`` after ``lseek``,
``fdatasync``, ``fsync``; see ``nm -D`` on its extension). The approach is ALICE's (Pillai
et al., OSDI '14: record the system calls, then construct the states a crash may leave);
CrashMonkey and LazyFS record below the file system instead.

:func:`install_commit_markers` runs in the traced process: after each synced flush of the
event log returns it appends a ``mark`` record (the number of events then durable) to the
same trace, which is how the checks know which commits had returned before a cut.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nnx_es.errors import ConfigError

__all__ = ["NoCompilerError", "Op", "TRACE_FILE_VAR", "TRACE_ROOT_VAR", "build_shim", "install_commit_markers",
           "read_trace", "traced_env"]

TRACE_FILE_VAR = "NNX_ES_TRACE_FILE"
TRACE_ROOT_VAR = "NNX_ES_TRACE_ROOT"
_SOURCE = Path(__file__).with_name("trace_shim.c")
_HEADER = struct.Struct("<IB3xiiqqIIQ")
#: the shim's op codes (trace_shim.c) and the marker's
OPS = {1: "open", 2: "write", 3: "truncate", 4: "fsync", 5: "fdatasync", 6: "rename", 7: "unlink", 8: "mkdir",
       9: "rmdir", 10: "close", 11: "unsupported", 12: "mark"}
_MARK = 12


class NoCompilerError(ConfigError):
    """No C compiler (``cc``, ``$CC``) to build the tracing shim; power-loss tests need one."""


@dataclass(frozen=True)
class Op:
    """One traced call. op: a value of :data:`OPS`; fd: the descriptor (-1 for path calls);
    flags: ``open``'s flags; offset: a write's file offset (bytes); arg: a write's length, a
    truncate's new length (bytes), 1 for an ``open`` that created the file, a mark's value;
    path / path2: absolute paths (``rename``: from, to); data: a write's bytes."""

    op: str
    fd: int = -1
    flags: int = 0
    offset: int = 0
    arg: int = 0
    path: str = ""
    path2: str = ""
    data: bytes = b""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nnx_es" / "trace_shim"


def build_shim(cache: Path | None = None) -> Path:
    """The compiled shim, built on first use into ``cache`` (default ``~/.cache/nnx_es/trace_shim``)
    under a name holding the source's SHA-256 (a changed source builds anew).

    Raises:
        NoCompilerError: no ``$CC`` / ``cc`` / ``gcc`` / ``clang`` on ``PATH``, or it failed (its output named).
    """
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(cache) if cache is not None else _cache_dir()
    lib = cache / f"trace_shim-{digest}.so"
    if lib.exists():
        return lib
    candidates = [os.environ.get("CC", ""), "cc", "gcc", "clang"]
    compiler = next((shutil.which(c) for c in candidates if c and shutil.which(c)), None)
    if compiler is None:
        raise NoCompilerError("power-loss tests build an LD_PRELOAD shim and need a C compiler: none of $CC, cc, "
                              "gcc, clang is on PATH (install one, e.g. apt-get install gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
    proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SOURCE), "-ldl", "-lpthread"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NoCompilerError(f"{compiler} could not build {_SOURCE.name} (exit {proc.returncode}): "
                              f"{proc.stderr.strip()[-1500:]}")
    os.replace(tmp, lib)
    return lib


def traced_env(lib: Path, trace: Path, root: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a new process that records every persistence operation under ``root``
    (resolved) to ``trace``."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join([str(lib), *filter(None, [env.get("LD_PRELOAD", "")])])
    env[TRACE_FILE_VAR] = str(Path(trace).resolve())
    env[TRACE_ROOT_VAR] = str(Path(root).resolve())
    return env


def read_trace(path: Path) -> list[Op]:
    """The records of the trace file ``path``, in order.

    Raises:
        ValueError: the file ends inside a record (the traced process died while writing one).
    """
    raw = Path(path).read_bytes()
    ops: list[Op] = []
    i = 0
    while i < len(raw):
        if i + _HEADER.size > len(raw):
            raise ValueError(f"trace {path} ends inside a record header at byte {i}")
        total, op, fd, flags, offset, arg, n1, n2, nd = _HEADER.unpack_from(raw, i)
        if total != _HEADER.size + n1 + n2 + nd or i + total > len(raw):
            raise ValueError(f"trace {path} has a bad or short record at byte {i} (length {total})")
        j = i + _HEADER.size
        p1 = raw[j:j + n1].decode("utf-8", "surrogateescape")
        p2 = raw[j + n1:j + n1 + n2].decode("utf-8", "surrogateescape")
        data = raw[j + n1 + n2:i + total]
        ops.append(Op(OPS.get(op, f"unknown {op}"), fd, flags, offset, arg, p1, p2, data))
        i += total
    return ops


def _mark(value: int) -> None:
    """Append a ``mark`` record (value: events durable) to this process's trace, if it is traced."""
    path = os.environ.get(TRACE_FILE_VAR)
    if not path:
        return
    record = _HEADER.pack(_HEADER.size, _MARK, -1, 0, 0, value, 0, 0, 0)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, record)
    finally:
        os.close(fd)


def install_commit_markers() -> None:
    """In a traced process: mark the trace after every synced flush of an ``LmdbLog`` (a commit
    that returned), with the number of events it made durable."""
    from events.log import LmdbLog

    flush = LmdbLog.flush

    def marked(self: LmdbLog, *, sync: bool = False) -> None:
        flush(self, sync=sync)
        if sync:
            _mark(self.next_seq)

    LmdbLog.flush = marked  # type: ignore[method-assign]
