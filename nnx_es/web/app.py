"""The web app of ``nnx-es serve``: pages and the JSON API behind them (Starlette), read-only.

Pages (one HTML shell; ``static/app.js`` draws each from the API, with uPlot, shipped in ``static/``):

| page | API |
|---|---|
| ``/`` the runs | ``GET /api/runs`` |
| ``/runs/{id}`` summary, history, curves | ``GET /api/runs/{id}``, ``GET /api/runs/{id}/curves?per=epoch|update`` (per update: downsampled, read a bounded part of the log per request: :mod:`nnx_es.web.curves`) |
| ``/runs/{id}/events`` events, filtered and paged | ``GET /api/runs/{id}/events?from=&limit=&kind=&epoch=`` |
| ``/runs/{id}/events/{seq}`` one event, its commit group | ``GET /api/runs/{id}/events/{seq}`` |
| ``/runs/{id}/at`` time travel over seq | ``GET /api/runs/{id}/at?seq=`` |
| ``/runs/{id}/audit`` ``tools/replay``'s verdict | ``GET /api/runs/{id}/audit`` |
| ``/runs/{id}/rows`` the data map | ``GET /api/runs/{id}/rows`` |
| ``/diff?a=&b=`` two runs from their first difference | ``GET /api/diff?a=&b=`` |
| ``/studies`` the studies of ``nnx-es search`` | ``GET /api/studies`` |
| ``/studies/{name}`` a study's trials beside their runs | ``GET /api/studies/{name}`` |

Only ``GET`` (and ``HEAD``) is served; nothing under the runs root is written (:mod:`nnx_es.web.reading`).
Requests must name this machine (``Host``: a loopback name, or the address the server was bound to), so a
web page elsewhere cannot read the runs through a name it points at 127.0.0.1 (DNS rebinding); every
response forbids scripts, styles and connections from elsewhere (a Content-Security-Policy) and
framing. An error is one JSON object ``{"error": {"type", "message"}}`` with a status saying what kind
(400 a bad request, 403 a link or a wrong kind of file refused, 404 no such run or event, 422 a damaged
run, 503 a writer opened the log during the read: read again).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from events.errors import CorruptEventError, EventLogError, SequenceGapError, UnsafePathError, WriterAppearedError
from events.lmdbfile import MAX_SEQ
from events.paths import check_entry
from nnx_es.audit import NotARunError
from nnx_es.cli._common import writer_alive
from nnx_es.cli._format import json_line
from nnx_es.errors import CorruptCheckpointError, InvalidRunIdError
import nnx_es.web.api as api
import nnx_es.web.studies as study_pages
from nnx_es.web.curves import READ_BUDGET, UpdateCurves
from nnx_es.web.reading import RunsRoot

__all__ = ["LOOPBACK_HOSTS", "STATIC", "create_app", "hosts_for", "is_loopback"]

STATIC = Path(__file__).parent / "static"
#: the ``Host`` names a loopback server answers to
LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1", "[::1]")
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
#: (error types, HTTP status): the first that matches says the status
_STATUSES: tuple[tuple[tuple[type[BaseException], ...], int], ...] = (
    ((WriterAppearedError,), 503),
    ((InvalidRunIdError,), 400),
    ((UnsafePathError,), 403),
    ((NotARunError, api.NoSuchEventError, study_pages.NoSuchStudyError), 404),
    ((EventLogError, SequenceGapError, CorruptEventError, CorruptCheckpointError), 422),
    ((ValueError,), 400),
)


def _json(doc: Any, status: int = 200) -> Response:
    return Response(json_line(doc), status_code=status, media_type="application/json", headers=_HEADERS)


def _error(exc: BaseException) -> Response:
    status = next((code for types, code in _STATUSES if isinstance(exc, types)), 500)
    message = str(exc)
    if status == 422:
        message += "; tools/replay on the run names every damage"
    return _json({"error": {"type": type(exc).__name__, "message": message}}, status)


class _Cache:
    """Values by key, the ``size`` newest kept: the answers that read much of a log (a run's overview, its audit,
    its data map) by run and the state of its log file and writer -- a run that did not change since is
    answered again from memory -- and each run's per-update curves by its log's identity."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


def _log_state(run_dir: Path) -> tuple[Any, ...] | None:
    """What changes when a writer writes the log (size, modification time, inode) or its writer comes or
    goes (whether a process holds the run's writer lease), or None without a log."""
    st = check_entry(run_dir / "events.lmdb" / "data.mdb", "file")
    return None if st is None else (st.st_size, st.st_mtime_ns, st.st_ino, writer_alive(run_dir))


def create_app(runs_root: str | Path, *, allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
               curve_budget: int = READ_BUDGET) -> Starlette:
    """The app serving ``runs_root`` (see the module docstring); ``allowed_hosts``: the ``Host`` names it
    answers (``"*"``: any; a request naming another gets 400); ``curve_budget``: the most events one request
    of the per-update curves reads (:mod:`nnx_es.web.curves`).

    Raises:
        MissingDirectoryError: ``runs_root`` is not a directory.
    """
    root = RunsRoot(runs_root)
    cache = _Cache()
    update_curves = _Cache(size=16)  # each run's UpdateCurves, by its log's identity

    def cached(name: str, fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        def read(run_dir: Path) -> Any:
            return cache.get((name, str(run_dir), _log_state(run_dir)), lambda: fn(run_dir))
        return read

    def endpoint(work: Callable[[Request], Any]) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                return _json(await run_in_threadpool(work, request))
            except Exception as exc:  # noqa: BLE001 - every error is said as JSON, never a traceback
                return _error(exc)
        return handle

    overview = cached("overview", api.overview)  # the runs list, a run's page and its epoch curves: one read

    def runs(request: Request) -> Any:
        rows = []
        for run_id in root.run_ids():
            try:
                rows.append(api.run_row(root.read(overview, run_id)))
            except Exception as exc:  # noqa: BLE001 - one unreadable run does not hide the others
                rows.append(api.unreadable_row(run_id, exc))
        from nnx_es.search.study import study_names

        return {"root": str(root.path), **api.runs(rows), "studies": study_names(root.path)}

    def one(request: Request) -> Any:
        return api.run(root.read(overview, request.path_params["run_id"]))

    def per_update(run_dir: Path) -> Any:
        curves = update_curves.get(("update", *api.log_identity(run_dir)), UpdateCurves)
        return api.update_curves(run_dir, curves, curve_budget)

    def curves(request: Request) -> Any:
        text = request.query_params.get("per")
        per = api.CURVES if not text else tuple(p for p in api.CURVES if p in text.split(","))
        if text and (not per or set(text.split(",")) - set(api.CURVES)):
            raise ValueError(f"per: expected some of {', '.join(api.CURVES)} (comma-separated), got {text!r}")
        run_id = request.path_params["run_id"]
        out = {}
        if "epoch" in per:
            out["epoch"] = api.epoch_curves(root.read(overview, run_id))
        if "update" in per:
            out["update"] = root.read(per_update, run_id)
        return out

    def events(request: Request) -> Any:
        q = request.query_params
        kinds, epochs = api.parse_kinds(q.get("kind")), api.parse_epochs(q.get("epoch"))
        start = api.in_range("from", q.get("from"), 0, MAX_SEQ - 1, default=0)
        limit = api.in_range("limit", q.get("limit"), 1, api.MAX_LIMIT, default=100)
        return root.read(lambda d: api.events(d, start=start, limit=limit, kinds=kinds, epochs=epochs),
                         request.path_params["run_id"])

    def event(request: Request) -> Any:
        seq = int(request.path_params["seq"])
        if seq >= MAX_SEQ:
            raise api.NoSuchEventError(f"no event {seq}: a seq is below {MAX_SEQ}")
        return root.read(lambda d: api.event(d, seq), request.path_params["run_id"])

    def at(request: Request) -> Any:
        seq = api.in_range("seq", request.query_params.get("seq"), 0, MAX_SEQ - 1)
        return root.read(lambda d: api.at(d, seq), request.path_params["run_id"])

    def audit(request: Request) -> Any:
        return root.read(cached("audit", api.audit), request.path_params["run_id"])

    def rows(request: Request) -> Any:
        return root.read(cached("rows", api.rows), request.path_params["run_id"])

    def diff(request: Request) -> Any:
        a, b = request.query_params.get("a"), request.query_params.get("b")
        if not a or not b:
            raise ValueError("diff takes two runs: /api/diff?a=RUN_ID&b=RUN_ID")
        return root.read(api.diff, a, b)

    def studies(request: Request) -> Any:
        return study_pages.studies(root)

    def study(request: Request) -> Any:
        return study_pages.study(root, request.path_params["name"])

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=_HEADERS)

    async def favicon(request: Request) -> Response:
        return RedirectResponse("/static/favicon.svg")

    routes = [
        Route("/api/runs", endpoint(runs)),
        Route("/api/runs/{run_id}", endpoint(one)),
        Route("/api/runs/{run_id}/curves", endpoint(curves)),
        Route("/api/runs/{run_id}/events", endpoint(events)),
        Route("/api/runs/{run_id}/events/{seq:int}", endpoint(event)),
        Route("/api/runs/{run_id}/at", endpoint(at)),
        Route("/api/runs/{run_id}/audit", endpoint(audit)),
        Route("/api/runs/{run_id}/rows", endpoint(rows)),
        Route("/api/diff", endpoint(diff)),
        Route("/api/studies", endpoint(studies)),
        Route("/api/studies/{name}", endpoint(study)),
        Route("/", page),
        Route("/diff", page),
        Route("/studies", page),
        Route("/studies/{name}", page),
        Route("/runs/{run_id}", page),
        Route("/runs/{run_id}/{view:str}", page),
        Route("/runs/{run_id}/events/{seq:int}", page),
        Route("/favicon.ico", favicon),
        Mount("/static", app=StaticFiles(directory=STATIC, follow_symlink=False), name="static"),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(_SecurityHeaders),
                                               Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))])
    app.state.root = root
    return app


class _SecurityHeaders:
    """ASGI middleware: every response (the static files' too) carries :data:`_HEADERS` unless it set them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for k, v in _HEADERS.items():
                    if k not in headers:
                        headers[k] = v
            await send(message)

        await self.app(scope, receive, sending)


def hosts_for(host: str) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``host`` answers: the loopback names and ``host`` itself; any
    name when bound to every address (``0.0.0.0``, ``::``: whoever reaches it chose to)."""
    if host in ("0.0.0.0", "::", ""):
        return ("*",)
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, host, f"[{host}]" if ":" in host else host)))


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ``::1``, ``localhost``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

