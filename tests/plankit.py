"""Small plans and searches on digits, and kills aimed at one run or at the plan's log (for forked children).

``spec()``: the ``nnx-es init`` spec on digits, 2 epochs, batch 64 (23 updates an epoch). The kills
SIGKILL the process that installs them (a child of :func:`crashkit.run_killed`):

* :func:`kill_in_run`: at the n-th event recorded into the run whose id is given (mid-trial);
* :func:`kill_at_sync`: around the n-th synced commit of a log whose path holds a given text (a run's
  LAST commit: "during a commit"; the plan log's: between two steps of the plan).
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from events.log import LmdbLog
from nnx_es.injection import install_sync_hook
from nnx_es.recipes.runspec import RunSpec, scaffold
from nnx_es.testing.reference import Reference, read_log


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary directory on tmpfs when the machine has one (``NNX_ES_CRASH_DIR`` overrides): a SIGKILL keeps
    the page cache, so what survives a kill there is what survives on disk, without the fsyncs' cost."""
    base = os.environ.get("NNX_ES_CRASH_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        yield Path(d)


def spec(epochs: int = 2, **kw: Any) -> RunSpec:
    return scaffold(epochs=epochs, batch_size=64, **kw)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_run(run_id: str, n: int) -> Callable[[], None]:
    """A kill installer: SIGKILL just before the n-th (0-based) event recorded into run ``run_id`` here."""

    def install() -> None:
        from nnx_es.runtime.recording import Recorder

        original = Recorder.emit
        count = [0]

        def emit(self: Recorder, event: Any) -> int:
            if Path(self.log.path).parent.name == run_id:
                if count[0] == n:
                    _kill()
                count[0] += 1
            return original(self, event)

        Recorder.emit = emit  # type: ignore[method-assign]

    return install


def kill_at_sync(where: str, n: int, when: str) -> Callable[[], None]:
    """A kill installer: SIGKILL ``when`` (``"before"`` / ``"after"``) the n-th (0-based) synced commit of a
    log whose path contains ``where`` (a run id, or ``"plans"`` for the plan's log)."""

    def install() -> None:
        count = [0]

        def hook(index: int, at: str, log: LmdbLog) -> None:
            if where not in str(log.path):
                return
            if at == when and count[0] == n:
                _kill()
            if at == "after":
                count[0] += 1

        install_sync_hook(hook)

    return install


def kinds(run_dir: Path) -> list[str]:
    """The kinds of a run's events, in order."""
    return [e.KIND for _, e in read_log(run_dir)]


def check_same_runs(ref_root: Path, root: Path, run_ids: list[str]) -> None:
    """Each run under ``root`` ends bit for bit as its namesake under ``ref_root``: history, LAST, BEST, phase and
    callback checkpoints (manifest hashes: weights, optimizer, schedulers, RNG, counters), status; and audits clean."""
    for run_id in run_ids:
        ref = Reference.of(ref_root / run_id)
        ref.check_resumed(root / run_id, ref.status)
