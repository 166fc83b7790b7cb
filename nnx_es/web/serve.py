"""``nnx-es serve RUNS_ROOT [--host 127.0.0.1] [--port 8000]``: serve the web app with uvicorn until Ctrl-C."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nnx_es.cli._common import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNUSABLE
from nnx_es.cli._format import printable

__all__ = ["add_command", "listening_socket", "serve", "serve_in_thread"]


def serve(runs_root: str | Path, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``runs_root`` read-only at ``http://host:port/`` until interrupted (uvicorn, one process).

    Bound to loopback by default: only this machine reaches it. Another ``host`` is said on stderr
    (whoever reaches the address reads every run under the root; there is no log-in). The socket is
    bound and listening before the URL is printed (``port`` 0: the port picked is in it), so a client
    that reads that line connects at once.

    Raises:
        MissingDirectoryError: ``runs_root`` is not a directory (before anything is bound).
        ImportError: the ``web`` extra is not installed (``pip install 'nnx_es[web]'``).
        ConfigError: ``host:port`` cannot be bound (the OS's reason said; nothing printed on stdout).
    """
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("nnx-es serve needs the web extra: pip install 'nnx_es[web]' (Starlette and uvicorn)") from exc
    from nnx_es.web.app import create_app, hosts_for, is_loopback

    app = create_app(runs_root, allowed_hosts=hosts_for(host))
    sock = listening_socket(host, port)
    with sock:
        port = int(sock.getsockname()[1])
        if not is_loopback(host):
            print(f"nnx-es serve: listening on {host}, not loopback: anyone who reaches it reads every run under "
                  f"{Path(runs_root).resolve()} (read-only, no log-in)", file=sys.stderr)
        print(f"nnx-es serve: {Path(runs_root).resolve()} at {_url(host, port)}/ (read-only; Ctrl-C stops)",
              flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        server.run(sockets=[sock])


def serve_in_thread(app: Any, host: str = "127.0.0.1", start_timeout_s: float = 20.0) -> tuple[str, Any]:
    """Serve ``app`` (an ASGI app: :func:`nnx_es.web.create_app`) with uvicorn on a free port of ``host`` in a
    daemon thread of this process (a notebook, a test, a benchmark); return its base URL and the server
    (``server.should_exit = True`` stops it).

    Raises:
        ConfigError: ``host`` cannot be bound.
        RuntimeError: the server did not start within ``start_timeout_s`` seconds.
    """
    import uvicorn

    sock = listening_socket(host, 0)
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="nnx-es-serve")
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the web app did not start on {host}:{port} within {start_timeout_s} s")
        time.sleep(0.02)
    return _url(host, port), server


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening, as uvicorn binds one
    (``SO_REUSEADDR``; IPv6 when ``host`` holds a colon).

    Raises:
        ConfigError: the address cannot be bound (in use, not this machine's, a name that does not
            resolve): ``host:port`` and the OS's reason.
    """
    from nnx_es.errors import ConfigError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {_url(host, port)[7:]}: {exc.strerror or exc} (pass another --port, 0 "
                          "for any free one, or a --host address of this machine)") from None
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _port(text: str) -> int:
    n = int(text) if text.isdigit() else -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"--port takes 0..65535, got {text!r}")
    return n


def _run(args: argparse.Namespace) -> int:
    from nnx_es.errors import ConfigError, MissingDirectoryError

    try:
        serve(args.runs_root, host=args.host, port=args.port)
    except (MissingDirectoryError, ImportError, ConfigError) as exc:
        print(printable(f"nnx-es serve: {exc}"), file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK


def add_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve`` to ``nnx-es``'s sub-commands."""
    p = sub.add_parser("serve", help="a read-only web app over a runs root: runs, curves, events, time travel, audit",
                       description="Serve RUNS_ROOT read-only over HTTP: the runs, each run's curves, events, time "
                       "travel over seq, the audit, the diff of two runs and the data map; the JSON API under /api. "
                       "Nothing under RUNS_ROOT is written. Needs the web extra (pip install 'nnx_es[web]'). The URL "
                       "is printed once the socket listens. Exit status: 0 stopped, 2 bad input (RUNS_ROOT not a "
                       "directory, the web extra missing, --host:--port cannot be bound), 130 Ctrl-C.")
    p.add_argument("runs_root", type=Path, metavar="RUNS_ROOT", help="the directory the runs are under (runs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    p.set_defaults(run=_run)
