"""What the event-log tests share: events to append and a read-only LmdbLog in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from events import EpochBegan, Event, MicrobatchDone, UpdateCommitted


__all__ = ["REPO", "Reader", "microbatch", "mixed", "receipt"]

REPO = Path(__file__).resolve().parents[2]


def microbatch(i: int) -> MicrobatchDone:
    return MicrobatchDone(epoch=0, batch=i, rows=32, examples=32.0, loss=1.0 / (i + 1))


def receipt(step: int) -> UpdateCommitted:
    return UpdateCommitted(
        step=step, epoch=0, microbatches=2, local_examples=64.0, global_examples=64.0, loss=0.5, lrs=[0.1]
    )


def mixed(n: int) -> list[Event]:
    """``n`` events of three kinds: epoch_began at 0, then microbatches with a receipt every third."""
    out: list[Event] = [EpochBegan(epoch=0)]
    for i in range(1, n):
        out.append(receipt(i) if i % 3 == 0 else microbatch(i))
    return out

READER = r"""
import json, sys
from events import EventLogError, LmdbLog, MicrobatchDone
r = LmdbLog(sys.argv[1], readonly=True, map_size=int(sys.argv[2]))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "read":
        raw = [v.hex() for _, v in r.read_raw()]
        out = {"next_seq": r.next_seq, "raw": raw, "kinds": [e.KIND for _, e in r.read()]}
    elif cmd == "refresh":
        out = {"n": r.refresh()}
    elif cmd == "write":
        out = {}
        for name, op in (
            ("append", lambda: r.append(MicrobatchDone(epoch=0, batch=0, rows=1, examples=1.0, loss=0.0))),
            ("flush", lambda: r.flush()),
        ):
            try:
                op()
                out[name] = "accepted"
            except EventLogError as exc:
                out[name] = type(exc).__name__
        out["next_seq"] = r.next_seq
    print(json.dumps(out), flush=True)
r.close()
"""


class Reader:
    """A read-only LmdbLog in a child process, driven line by line over stdin/stdout."""

    def __init__(self, path: Path, map_size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, str(path), str(map_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"reader process died (exit {self.proc.poll()})"
        return json.loads(line)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
