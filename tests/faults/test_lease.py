"""The writer lease of a run, seen through the Trainer.

One writer per run: a second ``fit`` on a run whose lease is held (by this process or by a
live writer child) is refused with :class:`LeaseHeldError` naming the run, before it reads
or writes anything; a SIGKILLed writer frees the lease and its run resumes; temporaries a
hard kill left are removed when the run is next opened, and reported (``RunResumed``
and a structlog warning).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import torch
from torch import nn

from crashkit import install_storage_hook, kill_at_event, run_killed, sigkill
from events.schema import RunResumed
from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.checkpoint import INLINE_MAX
from nnx_es.errors import LeaseHeldError, NnxError
from nnx_es.storage import Lease
from projections import project
from trainkit import EpochCounter, loaders, read_events, small_net

torch.set_num_threads(1)

EPOCHS = 3
RUN_ID = "r"


Counter = EpochCounter


def make_trainer(runs: Path, run_id: str | None, callback: Callback | None = None, ballast: bool = False) -> Trainer:
    net = small_net(0)
    if ballast:  # a model state above INLINE_MAX: each checkpoint writes one blob file
        net.register_buffer("ballast", torch.zeros(INLINE_MAX // 4 + 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=[callback or Counter()],
                   accumulation=2, runs_root=runs, run_id=run_id, seed=0, progress=False)


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=8, n_train=32), epochs=EPOCHS, **kw)


def _history(run_dir: Path) -> list[Any]:
    return [msgspec.structs.replace(r, wall_time_s=0.0) for r in project(read_events(run_dir)).history.records]


def _audit_ok(run_dir: Path) -> None:
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, Any]:
    runs = tmp_path_factory.mktemp("clean")
    trainer = make_trainer(runs, RUN_ID)
    fit(trainer)
    return {"params": {k: v.clone() for k, v in trainer.net.state_dict().items()}, "history": _history(runs / RUN_ID)}


def _assert_bitwise(trainer: Trainer, clean: dict[str, Any]) -> None:
    params = {k: v for k, v in trainer.net.state_dict().items() if k != "ballast"}
    assert params.keys() == clean["params"].keys()
    for k, v in params.items():
        assert torch.equal(v, clean["params"][k]), k


def test_a_second_writer_is_refused_while_the_lease_is_held_and_touches_nothing(tmp_path, clean):
    runs = tmp_path / "runs"
    fit(make_trainer(runs, RUN_ID))
    run_dir = runs / RUN_ID
    before = read_events(run_dir)
    files = sorted(p for p in run_dir.rglob("*") if p.is_file() and p.name != "lock.mdb")
    stale = run_dir / "blobs" / ".left.1.dead.tmp"
    stale.parent.mkdir(exist_ok=True)  # a small model's checkpoints write no blob file
    stale.write_bytes(b"half")
    with Lease(runs, RUN_ID):
        with pytest.raises(LeaseHeldError, match=rf"run '{RUN_ID}' is being written by another process") as info:
            fit(make_trainer(runs, None), resume_from=run_dir)
        assert isinstance(info.value, NnxError) and isinstance(info.value, BlockingIOError)
        with pytest.raises(LeaseHeldError, match=RUN_ID):
            fit(make_trainer(runs, RUN_ID))  # a fresh run of the same id: refused before anything else
    # the refused writers read nothing, wrote nothing, cleaned nothing
    assert read_events(run_dir) == before
    assert stale.exists()
    assert sorted(p for p in run_dir.rglob("*") if p.is_file() and p.name not in ("lock.mdb",) and p != stale) == files
    # released: the resume goes ahead (nothing left to train) and cleans the temporary
    run = fit(make_trainer(runs, None), resume_from=run_dir)
    assert run.status == "completed" and not stale.exists()
    assert _history(run_dir) == clean["history"]
    _audit_ok(run_dir)


def _slow_writer(runs: Path, ready_fd: int) -> None:
    """Child body: train, announce epoch 1 once it began (its epoch 0 is committed), then stall."""

    def stall(ctx: Any) -> None:
        if ctx.epoch == 1:
            os.write(ready_fd, b"in epoch 1")
            time.sleep(60)  # the parent SIGKILLs us long before

    fit(make_trainer(runs, RUN_ID, Counter(on_epoch_begin=stall)))


def test_a_live_writer_child_holds_the_lease_until_sigkill_frees_it_and_the_run_resumes(tmp_path, clean):
    runs = tmp_path / "runs"
    run_dir = runs / RUN_ID
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(r)
        try:
            _slow_writer(runs, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as ready:
            assert ready.read(10) == b"in epoch 1", "the writer child never reached epoch 1"
        # beside the live writer: a second writer is refused, naming the run
        with pytest.raises(LeaseHeldError, match=rf"run '{RUN_ID}'"):
            fit(make_trainer(runs, None), resume_from=run_dir)
        with pytest.raises(LeaseHeldError, match=rf"run '{RUN_ID}'"):
            Lease(runs, RUN_ID).acquire()
        # ... while a reader audits the live run read-only: epoch 0 is committed
        report = audit_run(run_dir)
        assert report.ok and report.committed_epoch == 0 and report.status == "running"
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    # the kernel dropped the dead writer's lock: the lease is free, and the run resumes exactly
    with Lease(runs, RUN_ID) as lease:
        assert lease.held
    trainer = make_trainer(runs, None)
    run = fit(trainer, resume_from=run_dir)
    assert run.status == "completed"
    resumed = [e for _, e in read_events(run_dir) if isinstance(e, RunResumed)]
    assert len(resumed) == 1 and resumed[0].epoch == 0
    _assert_bitwise(trainer, clean)
    assert _history(run_dir) == clean["history"]
    _audit_ok(run_dir)


def test_a_sigkilled_writer_frees_the_lease(tmp_path, clean):
    runs = tmp_path / "runs"
    assert run_killed(lambda: fit(make_trainer(runs, RUN_ID)), kill_at_event(30)) == "killed"
    with Lease(runs, RUN_ID) as lease:
        assert lease.held and lease.path.read_text().strip() == str(os.getpid())
    trainer = make_trainer(runs, None)
    fit(trainer, resume_from=runs / RUN_ID)
    _assert_bitwise(trainer, clean)


def _kill_after_write(n: int):
    """SIGKILL right after the n-th (0-based) temporary-file write of ``atomic_write``."""

    def install() -> None:
        writes = [0]

        def hook(op, caller, index, when, args):
            if op == "write" and when == "after":
                if writes[0] == n:
                    sigkill()
                writes[0] += 1

        install_storage_hook(hook)

    return install


def test_stale_temporaries_of_a_hard_kill_are_cleaned_on_the_next_open_and_reported(tmp_path, clean):
    runs = tmp_path / "runs"
    run_dir = runs / RUN_ID
    # each checkpoint writes one file, the model's blob (the manifest goes to the log):
    # killed right after writing the third checkpoint's temporary (epoch 1's), one real leftover
    assert run_killed(lambda: fit(make_trainer(runs, RUN_ID, ballast=True)), _kill_after_write(2)) == "killed"
    left = sorted(run_dir.rglob(".*.tmp"))
    assert len(left) == 1 and all(p.parent.name == "sha256" for p in left)
    # and more, as other hard kills would leave them
    planted = [run_dir / "blobs" / "sha256" / "ab" / ".x.123.abcd.tmp", run_dir / "views" / ".history.csv.9.beef.tmp"]
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"torn")
    kept = [run_dir / "blobs" / "sha256" / "ab" / "notes.tmp", run_dir / "views" / "history.csv.tmp"]  # not ours
    for p in kept:
        p.write_bytes(b"not a temporary of ours")
    stale = sorted([*left, *planted])
    with structlog.testing.capture_logs() as logs:
        trainer = make_trainer(runs, None, ballast=True)
        fit(trainer, resume_from=run_dir)
    assert sorted(run_dir.rglob(".*.tmp")) == []
    assert all(p.exists() for p in kept)
    resumed = [e for _, e in read_events(run_dir) if isinstance(e, RunResumed)]
    assert len(resumed) == 1 and resumed[0].cleaned_temporaries == len(stale) == 3
    warnings = [e for e in logs if e["event"] == "removed stale temporaries"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning" and warnings[0]["run_id"] == RUN_ID
    assert sorted(warnings[0]["files"]) == sorted(str(p) for p in stale)
    _assert_bitwise(trainer, clean)
    _audit_ok(run_dir)


def test_a_process_forked_by_the_writer_does_not_keep_the_lease_after_the_writer_is_killed(tmp_path):
    """DataLoader workers are forked from the writer: the lease must not outlive it in them."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import os, signal, sys, time\n"
        "from nnx_es.storage import Lease\n"
        "Lease(sys.argv[1], 'r').acquire()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "open(os.path.join(sys.argv[1], 'child'), 'w').write(str(child))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    # no pipes: the run returns when the writer dies, not when the child does
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=180)
    child = int((tmp_path / "child").read_text())
    try:
        os.kill(child, 0)  # the forked child outlives the killed writer
        lease = Lease(tmp_path, "r").acquire()  # and the lease is free all the same
        lease.release()
    finally:
        os.kill(child, signal.SIGKILL)
        time.sleep(0.05)
