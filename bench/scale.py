"""Benchmark of issue 14: readers, the audit and the training process on a long run.

``python -m bench.scale [--events N] [--small] [--dir DIR] [--skip-replay]``

1. writes, once, a finished run of ``N`` events (default 10 M; ``--small``: 200 k) with
   :func:`bench.logbench.long_run_log`, storing projection snapshots as the runtime's
   recorder does (:func:`nnx_es.runtime.recording.store_snapshot` after each commit, every
   :data:`nnx_es.runtime.recording.SNAPSHOT_EVERY` events), and reports the CPU time those calls
   took per event (the snapshots' cost on a writer's thread);
2. runs each reader in a fresh interpreter (so each one's memory is its own): ``load_result``,
   ``inspect summary``, ``inspect --at`` at several seqs (among them the worst case, the
   seq just before a snapshot), the first page of ``inspect`` (``--limit 20``), what a
   stateful resume reads (``find_resume_point``) and ``tools/replay --json``; for each, wall and CPU seconds and the peak anonymous memory
   (``RssAnon`` of ``/proc/self/status``, sampled every 5 ms: the resident memory that is
   not the log's file-backed mapped pages) and the peak resident set (``VmHWM``, pages of
   the log included);
3. trains a small model for two run lengths (one 4x the other) in fresh interpreters and
   reports the training process's peak anonymous memory for each.

Timing belongs here, never in tests; ``tests/integration/test_scale_readers.py`` runs the
same readers on a modest log and checks their answers equal a fold from 0.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

__all__ = ["Memory", "answers_equal_full_fold", "main", "write_run"]

ROOT = Path(__file__).resolve().parent.parent


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Memory:
    """Peak ``RssAnon`` of this process while the ``with`` block runs (sampled every 5 ms), in MB."""

    def __enter__(self) -> Memory:
        self.before_mb = _status_kb("RssAnon") / 1024
        self.peak_mb = self.before_mb
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_mb = max(self.peak_mb, _status_kb("RssAnon") / 1024)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, _status_kb("RssAnon") / 1024)
        self.hwm_mb = _status_kb("VmHWM") / 1024


def write_run(root: Path, n_events: int, snapshot_every: int | None = None) -> tuple[Path, int, float]:
    """Write a finished run of about ``n_events`` events under ``root/long``; return (run dir,
    events, CPU µs per event the snapshot calls took)."""
    from bench.logbench import long_run_log
    from nnx_es.runtime import recording as recorder

    run_dir = root / "long"
    cpu: list[float] = []
    n = long_run_log(run_dir / "events.lmdb", n_events, snapshot_every=snapshot_every or recorder.SNAPSHOT_EVERY,
                     snapshot_cpu_s=cpu)
    return run_dir, n, sum(cpu) / n * 1e6


def _reader(name: str, run_dir: Path, arg: int | None) -> dict[str, Any]:
    """Run one reader in this process; what it took."""
    from nnx_es import load_result
    from nnx_es.cli import inspect as inspect_cli
    from nnx_es.cli import replay as replay_cli

    calls = {
        "load_result": lambda: load_result(run_dir),
        "summary": lambda: inspect_cli.main([str(run_dir), "summary", "--json"]),
        "at": lambda: inspect_cli.main([str(run_dir), "--at", str(arg), "--json"]),
        "first page": lambda: inspect_cli.main([str(run_dir), "--limit", "20"]),
        "replay": lambda: replay_cli.main([str(run_dir), "--json"]),
        "resume": lambda: _resume_point(run_dir),
    }
    import resource

    def children_cpu() -> float:  # the audit's second process (nnx_es.audit.segments), once waited for
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    out = io.StringIO()
    with Memory() as mem, redirect_stdout(out):
        t0, c0, k0 = time.perf_counter(), time.process_time(), children_cpu()
        value = calls[name]()
        wall, cpu, kids = time.perf_counter() - t0, time.process_time() - c0, children_cpu() - k0
    ok = value == 0 if isinstance(value, int) else value is not None
    if name == "replay":
        ok = json.loads(out.getvalue())["ok"] is not None  # the long log names its missing blobs: not ok, by design
    return {"wall_s": wall, "cpu_s": cpu, "children_cpu_s": kids, "anon_peak_mb": mem.peak_mb, "anon_before_mb": mem.before_mb,
            "hwm_mb": mem.hwm_mb, "ran": ok}


def _resume_point(run_dir: Path) -> int:
    """What a stateful resume reads before it restores: :func:`nnx_es.resume.find_resume_point`
    (every key, value and checksum; the committed view folded from the newest snapshot). The
    long log stores no blob, so it ends refusing LAST's missing manifest: 0 when it got there."""
    from events.log import LmdbLog
    from nnx_es.errors import ResumeError
    from nnx_es.resume import find_resume_point

    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        try:
            find_resume_point(run_dir, log)
        except ResumeError as exc:
            return 0 if "manifest" in str(exc) else 1
    return 1


def _train(events: int) -> dict[str, Any]:
    """Train a tiny model for about ``events`` events in this process; its peak anonymous memory."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nnx_es import Trainer
    from nnx_es.runtime import recording as recorder

    torch.set_num_threads(1)
    spent = [0.0, 0, 0.0]  # CPU seconds in the recorder's snapshot step, snapshots stored, longest call
    store = recorder.store_snapshot

    def timed(log: Any, folder: Any) -> int | None:
        t0 = time.process_time()
        seq = store(log, folder)
        dt = time.process_time() - t0
        spent[0] += dt
        spent[2] = max(spent[2], dt)
        spent[1] += seq is not None
        return seq

    recorder.store_snapshot = timed  # type: ignore[assignment]
    rows = 4000
    epochs = max(1, events // (2 * rows))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=g)
    y = (x[:, 0] > 0).long()
    net = nn.Linear(4, 2)
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_scale_train_"))
    try:
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01), nn.CrossEntropyLoss(), runs_root=root,
                          run_id="t", progress=False)
        with Memory() as mem:
            t0 = time.process_time()
            result = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=1), epochs=epochs)
            cpu = time.process_time() - t0
        return {"events": result.events, "epochs": epochs, "anon_peak_mb": mem.peak_mb,
                "anon_before_mb": mem.before_mb, "cpu_s": cpu, "snapshot_cpu_s": spent[0], "snapshots": spent[1],
                "snapshot_longest_ms": spent[2] * 1e3,
                "microbatches": result.counters.batch}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _child(args: list[str]) -> dict[str, Any]:
    """Run ``python -m bench.scale --child ...`` in a fresh interpreter; its JSON answer."""
    done = subprocess.run([sys.executable, "-m", "bench.scale", "--child", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"bench child {args} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def answers_equal_full_fold(run_dir: Path, seqs: list[int]) -> dict[str, bool]:
    """Whether each snapshot-based reader's answer equals a fold of the whole prefix from 0
    (``load_result``; ``inspect --at`` at each of ``seqs``; ``inspect summary``'s projections)."""
    import msgspec

    from events.log import LmdbLog
    from nnx_es import load_result
    from nnx_es.audit import project_log
    from nnx_es.cli import inspect as inspect_cli
    from nnx_es.result import result_of
    from nnx_es.views import summary as summary_of
    from projections.view import project

    def full(stop: int | None = None) -> Any:
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
            return project(log.read(0, stop)), log.next_seq

    def printed(argv: list[str]) -> dict[str, Any]:
        buf = io.StringIO()
        with redirect_stdout(buf):
            inspect_cli.main(argv)
        return json.loads(buf.getvalue())

    out: dict[str, bool] = {}
    whole, n = full()
    out["load_result"] = load_result(run_dir) == result_of(whole, run_dir, n)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        out["started from a snapshot"] = project_log(log).start > 0
    for seq in seqs:
        doc = printed([str(run_dir), "--at", str(seq), "--json"])
        out[f"--at {seq}"] = doc["projections"] == json.loads(msgspec.json.encode(full(seq + 1)[0]))
    doc = printed([str(run_dir), "summary", "--json"])
    want = json.loads(msgspec.json.encode(summary_of(whole)))
    out["summary"] = all(doc[k] == v for k, v in want.items())
    return out


def _snapshot_seqs(run_dir: Path) -> list[int]:
    from events.log import LmdbLog

    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return [s for s, _ in log.read_snapshots(newest_first=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.scale", description=__doc__.partition("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--small", action="store_true", help="200 k events")
    parser.add_argument("--dir", type=Path, default=None, help="where the run goes (kept; reused when present)")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-readers", action="store_true", help="only the training process's memory")
    parser.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        kind, *rest = args.child
        if kind == "train":
            doc = _train(int(rest[0]))
        else:
            doc = _reader(kind.replace("_", " ") if kind == "first_page" else kind, Path(rest[0]),
                          int(rest[1]) if len(rest) > 1 else None)
        print(json.dumps(doc))
        return 0
    n_events = 200_000 if args.small else args.events
    root = args.dir or Path(tempfile.mkdtemp(prefix="nnx_bench_scale_"))
    owned = args.dir is None
    try:
        run_dir = root / "long"
        if args.skip_readers:
            pass
        elif not (run_dir / "events.lmdb" / "data.mdb").exists():
            t0 = time.perf_counter()
            run_dir, n, snap_us = write_run(root, n_events)
            print(f"wrote {n} events in {time.perf_counter() - t0:.1f} s; snapshot calls {snap_us:.3f} CPU µs/event")
        if not args.skip_readers:
            _readers(run_dir, args.skip_replay)
        if not args.skip_train:
            short = 20_000 if args.small else 100_000
            print("\n| training process | events | peak anon MB | anon before fit MB | CPU s | snapshots | "
                  "snapshot step CPU µs per microbatch | longest snapshot step (one commit) ms |")
            print("|---|---|---|---|---|---|---|---|")
            for events in (short, 4 * short):
                r = _child(["train", str(events)])
                print(f"| tiny linear model, batch 1 | {r['events']} | {r['anon_peak_mb']:.0f} | "
                      f"{r['anon_before_mb']:.0f} | {r['cpu_s']:.1f} | {r['snapshots']} | "
                      f"{r['snapshot_cpu_s'] / max(r['microbatches'], 1) * 1e6:.2f} | "
                      f"{r['snapshot_longest_ms']:.1f} |")
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _readers(run_dir: Path, skip_replay: bool) -> None:
    """Time every reader on ``run_dir`` in fresh interpreters; print the table."""
    from events.log import LmdbLog

    size = sum(p.stat().st_size for p in (run_dir / "events.lmdb").iterdir())
    snaps = _snapshot_seqs(run_dir)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        n = log.next_seq
        snap_bytes = sum(len(v) for _, v in log.read_snapshots())
    print(f"log: {n} events, {size / 1e6:.0f} MB on disk, {len(snaps)} snapshots ({snap_bytes / 1e6:.1f} MB)")
    worst = snaps[1] - 1 if len(snaps) > 1 else n - 1  # folds the most events since a snapshot (or 0)
    rows: list[tuple[str, dict[str, Any]]] = [("load_result", _child(["load_result", str(run_dir)])),
                                              ("inspect summary", _child(["summary", str(run_dir)]))]
    for seq in (10, worst, n // 2, n - 1):
        rows.append((f"inspect --at {seq}", _child(["at", str(run_dir), str(seq)])))
    rows.append(("inspect --limit 20 (first page)", _child(["first_page", str(run_dir)])))
    rows.append(("resume point (find_resume_point, up to the blob check)", _child(["resume", str(run_dir)])))
    if not skip_replay:
        rows.append(("tools/replay --json", _child(["replay", str(run_dir)])))
    print(f"\n| reader ({n} events) | wall s | CPU s | peak anon MB | peak RSS MB (mapped log included) |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        extra = f" ({n / r['wall_s'] / 1e6:.2f} M events/s)" if name.startswith("tools/replay") else ""
        kids = f" + {r['children_cpu_s']:.3f} in its second process" if r.get("children_cpu_s") else ""
        print(f"| {name} | {r['wall_s']:.3f}{extra} | {r['cpu_s']:.3f}{kids} | {r['anon_peak_mb']:.0f} | "
              f"{r['hwm_mb']:.0f} |")
    print(f"(load average when done: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f})")


if __name__ == "__main__":
    sys.exit(main())
