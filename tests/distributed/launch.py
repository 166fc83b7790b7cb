"""Launch helpers for the 2-process torchrun tests (gloo, CPU, loopback only).

Every launch gets a free port (bound to port 0 on 127.0.0.1), its own process session
(so a timeout kills torchrun and every rank it started) and a subprocess timeout: nothing
may hang. A scenario script writes one JSON result per rank and case
(``<out>/<case>.rank<r>.json``, see :func:`write_result`); :func:`results` reads them back.

Reused by every test under ``tests/distributed`` (equivalence, refusals, the multi-node
and elastic cases).

``warm=True``: torchrun's agent (a new interpreter: rendezvous, ranks' environment, monitoring,
restarts) starts each rank with ``--no-python`` as warmkit's ``python`` shim, so a rank is a child of
one of the suite's two warm processes (tests/warmkit.py: rank r in process r % 2, so two neighbouring
ranks' string hash seeds differ, as two new interpreters' do) with torch imported once, not a new
interpreter importing it (~4 s of CPU each); its environment, arguments, output, exit status and death
by a signal are the rank's as torchrun gave them. The tests of launching itself (several agents, elastic
restarts, the agent's store) start their ranks as new interpreters (``warm=False``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: a launch that takes longer than this is killed (seconds)
DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for_ranks(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: the repo on the path, one thread per rank, gloo on loopback."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def torchrun(script: str | Path, *args: str, nproc: int = 2, nnodes: int | str = 1, node_rank: int | None = None,
             port: int | None = None, max_restarts: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
             env: dict[str, str] | None = None, wait: bool = True, options: tuple[str, ...] = (),
             warm: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run ``script args`` under ``python -m torch.distributed.run`` with a c10d rendezvous on 127.0.0.1.

    ``nnodes`` > 1 with ``node_rank``: one agent of a multi-node launch (start one per node with
    the same ``port``); ``"MIN:MAX"``: one agent of an elastic membership (torchrun's own syntax).
    ``options``: more torchrun options (``--rdzv-conf=...``). ``wait=False`` returns the ``Popen``
    (its own session: kill it with :func:`kill`). On timeout the whole launch is killed and
    ``subprocess.TimeoutExpired`` raised. ``warm``: the ranks are children of the warm process (the
    module's docstring), else new interpreters.
    """
    port = port or free_port()
    env = dict(env or {})
    if warm:
        import warmkit  # here: the scenario scripts import this module for write_result, without tests/ on their path

        options = ("--no-python", *options)
        env[warmkit.SOCKET_VAR] = warmkit.sockets()  # rank r in warm process r % 2: neighbours' hash seeds differ
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5", *options]
    if isinstance(nnodes, int) and nnodes > 1 and node_rank is not None:
        cmd.append(f"--node-rank={node_rank}")
    if warm:
        cmd += [str(warmkit.shared().python_shim()), "-u"]
    cmd += [str(script), *args]
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env_for_ranks(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if not wait:
        return proc
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout_s, output=out) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def kill(proc: subprocess.Popen) -> None:
    """Kill a launch started with ``wait=False`` and every process of its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_result(out_dir: str | Path, case: str, rank: int, result: dict[str, Any]) -> None:
    """Write one rank's result of ``case`` (JSON) -- called by scenario scripts."""
    path = Path(out_dir) / f"{case}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True, default=str))
    tmp.replace(path)


def results(out_dir: str | Path, case: str, nproc: int = 2) -> list[dict[str, Any]]:
    """Every rank's result of ``case``, in rank order (a missing one is ``{"missing": True}``)."""
    out: list[dict[str, Any]] = []
    for rank in range(nproc):
        path = Path(out_dir) / f"{case}.rank{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"missing": True})
    return out
