"""Live logging sinks: fed from the committed events while the run trains; a failing sink never fails it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

from nnx_es import CsvSink, TensorBoardSink, Trainer
from nnx_es.errors import ConfigError
from nnx_es.sinks import SinkWarning, scalars_of
from trainkit import loaders, read_events, small_net


def _trainer(tmp_path, run_id="r", **kw):
    net = small_net(0)
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), monitor="val_loss",
                   runs_root=tmp_path, run_id=run_id, progress=False, **kw)


class Seen:
    """A sink recording what it was given, and whether it was given it during the run."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str]] = []
        self.closed = False

    def open(self, run_dir):
        self.run_dir = run_dir

    def write(self, seq, event):
        self.events.append((seq, event.KIND))

    def close(self):
        self.closed = True


def test_csv_sink_writes_every_committed_epoch_and_update(tmp_path):
    run = _trainer(tmp_path, sinks=[CsvSink(tmp_path / "csv")]).fit(*loaders(), epochs=3)
    with open(tmp_path / "csv" / "epochs.csv") as f:
        epochs = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in epochs] == [0, 1, 2]
    assert [float(r["val_loss"]) for r in epochs] == [h.val["val_loss"] for h in run.history]
    with open(tmp_path / "csv" / "updates.csv") as f:
        updates = list(csv.DictReader(f))
    receipts = [e for _, e in read_events(run.run_dir) if e.KIND == "update_committed"]
    assert [(int(u["step"]), float(u["loss"])) for u in updates] == [(r.step, r.loss) for r in receipts]


def test_a_sink_sees_exactly_the_committed_events_in_order_and_is_closed(tmp_path):
    seen = Seen()
    run = _trainer(tmp_path, sinks=[seen]).fit(*loaders(), epochs=2)
    assert seen.closed and seen.run_dir == Path(run.run_dir)
    assert seen.events == [(seq, e.KIND) for seq, e in read_events(run.run_dir)]  # a clean run: all committed


def test_a_failing_sink_is_warned_about_and_dropped_and_the_run_completes(tmp_path):
    class Broken(Seen):
        def write(self, seq, event):
            raise OSError("disk full")

    seen = Seen()
    with pytest.warns(SinkWarning, match="Broken failed in write"):
        run = _trainer(tmp_path, sinks=[Broken(), seen]).fit(*loaders(), epochs=2)
    assert run.status == "completed" and seen.closed and len(seen.events) == len(read_events(run.run_dir))


def test_tensorboard_sink_writes_the_offline_exports_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nnx_es.plotting import export_tensorboard

    run = _trainer(tmp_path, sinks=[TensorBoardSink(tmp_path / "live")]).fit(*loaders(), epochs=2)
    export_tensorboard(run.run_dir, tmp_path / "offline")

    def scalars(d):
        acc = EventAccumulator(str(d))
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    assert scalars(tmp_path / "live") == scalars(tmp_path / "offline")
    assert any(t.startswith("update/loss/") for t in scalars(tmp_path / "live"))


def test_sinks_must_be_sinks():
    with pytest.raises(ConfigError, match="sinks must be a list"):
        _trainer("unused", sinks="tb/")


def test_scalars_of_tags_as_the_export_does(tmp_path):
    run = _trainer(tmp_path).fit(*loaders(), epochs=1)
    history = next(e for _, e in read_events(run.run_dir) if e.KIND == "history_appended")
    tags = {t for t, _, _ in scalars_of(history)}
    assert {"epoch/loss", "epoch/val_loss", "epoch/lr/sgd/0"} <= tags


def test_csv_sink_of_a_resumed_run_keeps_the_epochs_and_updates_before_the_resume(tmp_path):
    # found in review: a resume rewrote epochs.csv / updates.csv with the resumed session's rows only
    from nnx_es import Callback

    class FailAt(Callback):
        def on_epoch_begin(self, ctx):
            if ctx.epoch == 2:
                raise RuntimeError("stop here")

    out = tmp_path / "csv"
    with pytest.raises(RuntimeError, match="stop here"):
        _trainer(tmp_path, sinks=[CsvSink(out)], callbacks=[FailAt()]).fit(*loaders(), epochs=4)
    seen = Seen()
    run = _trainer(tmp_path, sinks=[CsvSink(out), seen]).fit(*loaders(), epochs=4, resume_from=tmp_path / "r")
    assert seen.events[0][1] == "run_resumed"  # a sink that is not from_start: this session's events only
    with open(out / "epochs.csv") as f:
        epochs = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in epochs] == [0, 1, 2, 3]
    assert [float(r["val_loss"]) for r in epochs] == [h.val["val_loss"] for h in run.history]
    with open(out / "updates.csv") as f:
        updates = list(csv.DictReader(f))
    from projections.view import committed
    receipts = [e for _, e in committed(read_events(run.run_dir)) if e.KIND == "update_committed"]
    assert [(int(u["step"]), float(u["loss"])) for u in updates] == [(r.step, r.loss) for r in receipts]


_KILLED = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
import torch
from torch import nn
from nnx_es import Callback, TensorBoardSink, Trainer
from trainkit import loaders, small_net

class KillAt(Callback):
    def on_epoch_begin(self, ctx):
        if ctx.epoch == 3:
            time.sleep(1.0)  # the sinks' process has long written epoch 1 (flush_secs is 120 s: no timed flush)
            if {group!r}:
                os.killpg(0, signal.SIGKILL)  # the training process and its sinks' process at once
            os.kill(os.getpid(), signal.SIGKILL)

net = small_net(0)
Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root={root!r}, run_id="k",
        progress=False, callbacks=[KillAt()], sinks=[TensorBoardSink({tb!r})]).fit(*loaders(), epochs=5)
"""


def _killed_run(tmp_path: Path, *, group: bool) -> list[int]:
    """Train with a TensorBoardSink in a process SIGKILLed at epoch 3 (``group``: with its sinks' process);
    the epochs of the scalars in TensorBoard. Nothing of the launch outlives it."""
    import os
    import signal
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    script = _KILLED.format(tests=str(Path(__file__).resolve().parents[1]), root=str(tmp_path / "runs"), tb=str(tb),
                            group=group)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)  # ends when every holder of its output (the sinks' process) ended
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("a process of the killed run outlived it (its sinks' process waited for a batch forever)")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == -9, out[-3000:]
    committed = [e.record.epoch for _, e in read_events(tmp_path / "runs" / "k") if e.KIND == "history_appended"]
    assert committed[:2] == [0, 1], committed
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("epoch/loss")] if "epoch/loss" in acc.Tags()["scalars"] else []


def test_tensorboard_sink_of_a_run_killed_with_its_sinks_process_holds_the_scalars_of_its_committed_epochs(tmp_path):
    # found in a trial: the SummaryWriter flushes every 120 s, so a killed run lost its last scalars
    pytest.importorskip("tensorboard")
    assert _killed_run(tmp_path, group=True)[:2] == [0, 1]


def test_a_run_killed_alone_leaves_no_sinks_process_and_its_sinks_are_closed(tmp_path):
    # found with the test above: the sinks' process held the training process's end of its pipe, so once
    # the training process was killed it waited for a batch forever
    pytest.importorskip("tensorboard")
    assert _killed_run(tmp_path, group=False)[:2] == [0, 1]
