"""``inspect RUN export --tensorboard DIR --follow`` beside a live writer in a child process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from nnx_es import LambdaCallback, Trainer
from nnx_es.cli.follow import follow_tensorboard
from nnx_es.cli.inspect import main
from projections import project
from trainkit import loaders, read_events, small_net

pytest.importorskip("tensorboard")

EPOCHS = 4


def _writer(runs: Path, *, pause_s: float = 0.3, hang_after: int | None = None) -> int:
    """Fork a child that trains the run ``runs/live`` (pausing ``pause_s`` at each epoch's end; with
    ``hang_after``, it sleeps forever after that epoch until killed); return its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            def at_end(ctx) -> None:
                time.sleep(pause_s)
                if hang_after is not None and ctx.epoch >= hang_after:
                    time.sleep(3600)

            net = small_net()
            Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    callbacks=[LambdaCallback(on_epoch_end=at_end)], runs_root=runs, run_id="live",
                    progress=False).fit(*loaders(), epochs=EPOCHS)
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    deadline = time.time() + 30
    data = runs / "live" / "events.lmdb" / "data.mdb"
    # LMDB creates data.mdb empty and sizes it a moment later: readers refuse an empty one as truncated
    while not (data.exists() and data.stat().st_size > 0) and time.time() < deadline:
        time.sleep(0.02)
    return pid


def _scalars(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_follow_exports_a_live_run_as_the_one_shot_export_of_the_finished_run(tmp_path, capsys):
    runs = tmp_path / "runs"
    pid = _writer(runs)
    assert main([str(runs / "live"), "export", "--tensorboard", str(tmp_path / "live_tb"), "--follow"]) == 0
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    followed = capsys.readouterr().out
    assert main([str(runs / "live"), "export", "--tensorboard", str(tmp_path / "after_tb")]) == 0
    once = capsys.readouterr().out
    assert followed.split(" to ")[0] == once.split(" to ")[0]  # "wrote N scalars to ...": the same N
    live, after = _scalars(tmp_path / "live_tb"), _scalars(tmp_path / "after_tb")
    assert live == after
    history = project(read_events(runs / "live")).history.records
    assert [s for s, _ in live["epoch/loss"]] == [r.epoch for r in history] == list(range(EPOCHS))


def test_follow_of_a_killed_writer_stops_with_its_committed_epochs_only(tmp_path, capsys):
    runs = tmp_path / "runs"
    pid = _writer(runs, pause_s=0.0, hang_after=1)  # epochs 0 and 1 commit... epoch 1's end hangs
    killer = threading.Timer(2.0, lambda: os.kill(pid, signal.SIGKILL))
    killer.start()
    try:
        n = follow_tensorboard(runs / "live", tmp_path / "tb", poll_s=0.1)
    finally:
        killer.cancel()
        os.waitpid(pid, 0)
    assert "no process writes" in capsys.readouterr().err
    history = project(read_events(runs / "live")).history.records
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["epoch/loss"]] == [r.epoch for r in history] == [0]  # epoch 1 never committed
    assert n == sum(len(v) for v in scalars.values())


def test_follow_ends_on_ctrl_c_with_what_it_wrote_kept(tmp_path, capsys):
    runs = tmp_path / "runs"
    pid = _writer(runs, pause_s=0.0, hang_after=0)
    done = threading.Event()

    def interrupt_once_exporting() -> None:
        # Ctrl-C once the export has written its file (not after a fixed delay: a loaded machine may
        # not have started the writer by then); the deadline only ends a broken run of the test
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            if list((tmp_path / "tb").glob("events.out.tfevents.*")):
                time.sleep(0.3)
                break
            time.sleep(0.05)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    interrupt = threading.Thread(target=interrupt_once_exporting, daemon=True)
    interrupt.start()
    try:
        code = main([str(runs / "live"), "export", "--tensorboard", str(tmp_path / "tb"), "--follow"])
    finally:
        done.set()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert code == 130
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_follow_refuses_an_unbounded_poll_interval(tmp_path):
    with pytest.raises(ValueError, match="poll_s=60"):
        follow_tensorboard(tmp_path, tmp_path / "tb", poll_s=60)


def test_follow_of_a_run_continued_after_it_finalized_exports_every_session(tmp_path, capsys):
    # found in review: the follow stopped at the first run_finalized of the log, so a run that
    # completed (or failed) and was then resumed exported its first session's epochs only, and
    # following such a run while it trained again stopped at once
    runs = tmp_path / "runs"
    for epochs, resume in ((2, None), (4, runs / "live")):
        net = small_net()
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=runs,
                run_id="live", progress=False).fit(*loaders(), epochs=epochs, resume_from=resume)
    n = follow_tensorboard(runs / "live", tmp_path / "follow_tb", poll_s=0.1)
    assert main([str(runs / "live"), "export", "--tensorboard", str(tmp_path / "once_tb")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {n} scalars")
    followed = _scalars(tmp_path / "follow_tb")
    assert followed == _scalars(tmp_path / "once_tb")
    assert [s for s, _ in followed["epoch/loss"]] == [0, 1, 2, 3]
