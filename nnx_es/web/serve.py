"""``nnx-es serve RUNS_ROOT [--host 127.0.0.1] [--port 8000]``: serve the web app with uvicorn until Ctrl-C."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["add_command", "serve", "serve_in_thread"]


def serve(runs_root: str | Path, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``runs_root`` read-only at ``http://host:port/`` until interrupted (uvicorn, one process).

    Bound to loopback by default: only this machine reaches it. Another ``host`` is said on stderr
    (whoever reaches the address reads every run under the root; there is no log-in).

    Raises:
        MissingDirectoryError: ``runs_root`` is not a directory (before anything is bound).
        ImportError: the ``web`` extra is not installed (``pip install 'nnx_es[web]'``).
    """
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("nnx-es serve needs the web extra: pip install 'nnx_es[web]' (Starlette and uvicorn)") from exc
    from nnx_es.web.app import create_app, hosts_for, is_loopback

    app = create_app(runs_root, allowed_hosts=hosts_for(host))
    if port == 0:  # said in the URL printed below: pick the free port here
        port = _free_port(host)
    if not is_loopback(host):
        print(f"nnx-es serve: listening on {host}, not loopback: anyone who reaches it reads every run under "
              f"{Path(runs_root).resolve()} (read-only, no log-in)", file=sys.stderr)
    shown = f"[{host}]" if ":" in host else host
    print(f"nnx-es serve: {Path(runs_root).resolve()} at http://{shown}:{port}/ (read-only; Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def serve_in_thread(app: Any, host: str = "127.0.0.1", start_timeout_s: float = 20.0) -> tuple[str, Any]:
    """Serve ``app`` (an ASGI app: :func:`nnx_es.web.create_app`) with uvicorn on a free port of ``host`` in a
    daemon thread of this process (a notebook, a test, a benchmark); return its base URL and the server
    (``server.should_exit = True`` stops it).

    Raises:
        RuntimeError: the server did not start within ``start_timeout_s`` seconds.
    """
    import uvicorn

    port = _free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True, name="nnx-es-serve")
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the web app did not start on {host}:{port} within {start_timeout_s} s")
        time.sleep(0.02)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}", server


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port(text: str) -> int:
    n = int(text) if text.isdigit() else -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"--port takes 0..65535, got {text!r}")
    return n


def _run(args: argparse.Namespace) -> int:
    from nnx_es.errors import MissingDirectoryError

    try:
        serve(args.runs_root, host=args.host, port=args.port)
    except (MissingDirectoryError, ImportError) as exc:
        print(f"nnx-es serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve`` to ``nnx-es``'s sub-commands."""
    p = sub.add_parser("serve", help="a read-only web app over a runs root: runs, curves, events, time travel, audit",
                       description="Serve RUNS_ROOT read-only over HTTP: the runs, each run's curves, events, time "
                       "travel over seq, the audit, the diff of two runs and the data map; the JSON API under /api. "
                       "Nothing under RUNS_ROOT is written. Needs the web extra (pip install 'nnx_es[web]').")
    p.add_argument("runs_root", type=Path, metavar="RUNS_ROOT", help="the directory the runs are under (runs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    p.set_defaults(run=_run)
