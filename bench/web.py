"""Benchmark of ``nnx-es serve`` on a long run: what each page's answers cost, over HTTP.

``python -m bench.web [--events N] [--small] [--cache DIR] [--repeat K] [--cold]``

1. The run: a finished run of ``N`` events (default 10 M; ``--small``: 1 M) with projection snapshots as the
   runtime stores them (:func:`bench.scale.write_run`), written once and kept between runs of the benchmark
   (:func:`long_run`: a 10 M-event log takes minutes to write).
2. Each request a page makes is asked of a *fresh* server (uvicorn on a loopback port in this process, empty
   caches: :func:`nnx_es.web.create_app`), ``--repeat`` times; then once more of the same server (the answers
   kept while the log does not change). For each: the wall time and the CPU time of this process (the
   server's threads and the client) -- on a machine with other work, the wall time is the CPU time plus the
   wait for a core, so the load average is printed beside them. ``--cold`` first drops the log's pages from
   the page cache (``posix_fadvise(DONTNEED)``): the answer as the first reader after a reboot gets it.
3. The per-update curves until complete: how many answers the run page asks (each reads a bounded part of
   the log, :mod:`nnx_es.web.curves`) and what they cost together.

"The first page" is what a person opening a page waits for before anything shows: the runs list (``/``), a
run's page (its summary; its curves are drawn when they arrive, the first answer of the per-update ones
included), the first and the last page of its events and time travel to its middle. The issue asks each
under a second on a 10 M-event run. Timing belongs here, never in tests (``tests/integration/test_web_*``
check the answers).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["long_run", "main"]

ROOT = Path(__file__).resolve().parent.parent
#: the code that decides the bytes of the long run's log: a change to any of it writes the log again
_WRITER_SOURCES = ("bench/logbench.py", "bench/scale.py", "nnx_es/runtime/recording.py", "events", "projections")


def _writer_digest(n_events: int) -> str:
    digest = hashlib.sha256(str(n_events).encode())
    for rel in _WRITER_SOURCES:
        path = ROOT / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def long_run(n_events: int, cache: Path | None = None) -> tuple[Path, float | None]:
    """The runs root holding ``long``, a finished run of about ``n_events`` events with the runtime's projection
    snapshots (:func:`bench.scale.write_run`), and the seconds it took to write (None: found written).

    Kept between runs of the benchmark in ``cache`` (default ``$TMPDIR/nnx_bench_web``) under a name keyed by
    ``n_events`` and a hash of the code that writes it (:data:`_WRITER_SOURCES`). It is written in a
    directory of its own and renamed into place once complete (an interrupted write is never taken for a
    log); logs of the same length written by other versions of that code, and writes left by a benchmark
    that was killed, are removed.
    """
    from bench.scale import write_run

    cache = cache or Path(tempfile.gettempdir()) / "nnx_bench_web"
    final = cache / f"{n_events}-{_writer_digest(n_events)}"
    if (final / "runs" / "long" / "events.lmdb" / "data.mdb").is_file():
        return final / "runs", None
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob(f"{n_events}-*"):  # written by another version of the writer's code
        shutil.rmtree(stale, ignore_errors=True)
    for partial in cache.glob(".partial-*"):  # left by a benchmark that was killed while writing
        if not _alive(int(partial.name.split("-")[2])):
            shutil.rmtree(partial, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=f".partial-{n_events}-{os.getpid()}-", dir=cache))
    try:
        (partial / "runs").mkdir()
        t0 = time.perf_counter()
        write_run(partial / "runs", n_events)
        took = time.perf_counter() - t0
        os.rename(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final / "runs", took


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_pages(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (a hint to the kernel; clean pages go)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Server:
    """A fresh app over ``root`` served on a loopback port, and an HTTP client of it."""

    def __init__(self, root: Path) -> None:
        import httpx

        from nnx_es.web import create_app
        from nnx_es.web.serve import serve_in_thread

        url, self._server = serve_in_thread(create_app(root))
        self.client = httpx.Client(base_url=url, timeout=3600)

    def get(self, path: str) -> tuple[float, float, Any]:
        """``GET path``: (wall s, CPU s of this process, the JSON or text answered)."""
        t0, c0 = time.perf_counter(), time.process_time()
        r = self.client.get(path)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
        return wall, cpu, r.json() if r.headers["content-type"].startswith("application/json") else r.text

    def close(self) -> None:
        self.client.close()
        self._server.should_exit = True


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.web", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000, help="events in the long run (default 10 M)")
    parser.add_argument("--small", action="store_true", help="1 M events")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the long run is kept between runs (default $TMPDIR/nnx_bench_web)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh servers asked each request (default 3)")
    parser.add_argument("--cold", action="store_true", help="drop the log's pages from the page cache before each")
    args = parser.parse_args(argv)
    from events.log import LmdbLog

    n_events = 1_000_000 if args.small else args.events
    root, took = long_run(n_events, args.cache)
    data = root / "long" / "events.lmdb" / "data.mdb"
    with LmdbLog(data.parent, readonly=True) as log:
        n = log.next_seq
        snaps = [s for s, _ in log.read_snapshots(newest_first=False)]
    worst = snaps[1] - 1 if len(snaps) > 1 else n - 1  # folds the most events since a snapshot
    print(f"the run: {n:,} events, {data.stat().st_size / 1e9:.2f} GB, {len(snaps)} projection snapshots; "
          + (f"written in {took:.0f} s" if took is not None else f"kept from an earlier run in {root.parent}"))
    print(f"load average before: {_load()}")
    warm = _Server(root)  # the imports a server process pays once
    warm.get("/api/studies")
    warm.close()
    first_page = [
        ("`/`: the runs list", "/api/runs"),
        ("`/runs/long`: the run's summary", "/api/runs/long"),
        ("`/runs/long/events`: the first page (100)", "/api/runs/long/events?from=0&limit=100"),
        ("the last page of events", f"/api/runs/long/events?from={n - 100}&limit=100"),
        ("`/runs/long/at`: time travel to the middle", f"/api/runs/long/at?seq={n // 2}"),
    ]
    more = [
        ("the run's per-epoch curves", "/api/runs/long/curves?per=epoch"),
        ("the run's per-update curves: the first answer", "/api/runs/long/curves?per=update"),
        ("a middle page of events", f"/api/runs/long/events?from={n // 2}&limit=100"),
        ("a filtered page (kind=history_appended, 20)", "/api/runs/long/events?kind=history_appended&limit=20"),
        ("one event and its commit group", f"/api/runs/long/events/{n // 2}"),
        ("time travel just before a snapshot (the longest fold)", f"/api/runs/long/at?seq={worst}"),
        ("the page itself (HTML)", "/runs/long"),
    ]
    how = "the log's pages dropped from the page cache first" if args.cold else "the log's pages as the page cache has them"
    print(f"\neach request of a fresh server (empty caches), {args.repeat} times ({how}); then once more of the same "
          "server:\n")
    print("| request | wall s (median) | wall s (worst) | CPU s (median) | again, wall s |")
    print("|---|---:|---:|---:|---:|")
    firsts = []
    for name, path in first_page + more:
        walls, cpus, again = [], [], 0.0
        for i in range(args.repeat):
            if args.cold:
                _drop_pages(data)
            server = _Server(root)
            try:
                wall, cpu, _ = server.get(path)
                walls.append(wall)
                cpus.append(cpu)
                if i == args.repeat - 1:
                    again = server.get(path)[0]
            finally:
                server.close()
        row = (statistics.median(walls), max(walls), statistics.median(cpus), again)
        if (name, path) in first_page:
            firsts.append((name, *row))
        print(f"| {name} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} | {row[3]:.3f} |", flush=True)

    if args.cold:
        _drop_pages(data)
    server = _Server(root)
    try:
        answers, wall, cpu, slowest = 0, 0.0, 0.0, 0.0
        while True:
            w, c, doc = server.get("/api/runs/long/curves?per=update")
            answers, wall, cpu, slowest = answers + 1, wall + w, cpu + c, max(slowest, w)
            if doc["update"]["complete"]:
                break
        u = doc["update"]
        loss = u["series"]["loss/adam"]
    finally:
        server.close()
    print(f"\nthe per-update curves until complete: {answers} answers ({u['parts']} parts of {u['part']:,} seqs), "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU, the slowest answer {slowest:.3f} s; {loss['updates']:,} updates drawn as "
          f"{len(loss['x']):,} points (min and max of each {u['steps_per_bucket']:,} steps)")
    name, med, worst_wall, cpu, _ = max(firsts, key=lambda r: r[1])
    print(f"\nthe first page: the slowest of the five is {name.split(':')[0].strip('`')} at {med:.3f} s wall (median of "
          f"{args.repeat}; worst {worst_wall:.3f} s) and {cpu:.3f} s CPU")
    print(f"load average after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
