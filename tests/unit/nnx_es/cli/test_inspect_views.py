"""inspect for people: filters, --follow beside a live writer, --at time travel, --schema, plot, export."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn

from bench.logbench import long_run_log
from events.codec import CURRENT_TYPES
from events.log import LmdbLog
from nnx_es import EarlyStopping, Trainer
from nnx_es.cli.inspect import main
from projections import project, tail_length
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
    Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau],
            callbacks=[EarlyStopping(patience=5)], runs_root=runs, run_id="r", progress=False).fit(*loaders(), epochs=4)
    return runs / "r"


def _json_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_epoch_filter_keeps_exactly_the_events_of_those_epochs(run_dir, capsys):
    assert main([str(run_dir), "--epoch", "1:2", "--json"]) == 0
    rows = _json_lines(capsys)
    expected = [s for s, e in read_events(run_dir)
                if (e.record.epoch if e.KIND == "history_appended" else getattr(e, "epoch", None)) in (1, 2)]
    assert [r["seq"] for r in rows] == expected and expected


def test_rank_filter_attributes_the_log_to_the_writer_rank(run_dir, capsys):
    assert main([str(run_dir), "--rank", "0", "--json"]) == 0
    assert len(_json_lines(capsys)) == len(read_events(run_dir))
    assert main([str(run_dir), "--rank", "1", "--json"]) == 0
    assert _json_lines(capsys) == []


def test_a_rank_filter_that_matches_nothing_says_only_the_writer_ranks_events_are_logged(run_dir, capsys):
    """A fresh user's `inspect runs/<id> --rank 1` printed a header alone, as if rank 1 had done nothing."""
    assert main([str(run_dir), "--rank", "1"]) == 0
    got = capsys.readouterr()
    assert got.out.strip().count("\n") == 0  # the header alone
    assert "the log holds the writer rank's events (rank 0); rank 1's are not recorded" in got.err, got.err
    assert main([str(run_dir), "--rank", "0", "--limit", "1"]) == 0
    assert capsys.readouterr().err == ""  # the writer rank's events: nothing to explain


@pytest.mark.parametrize("at_kind", ["microbatch_done", "last_committed", "history_appended"])
def test_at_seq_prints_every_projection_as_of_that_point(run_dir, capsys, at_kind):
    events = read_events(run_dir)
    seq = [s for s, e in events if e.KIND == at_kind][2]
    assert main([str(run_dir), "--at", str(seq), "--json"]) == 0
    (doc,) = _json_lines(capsys)
    expected = project(events[: seq + 1])
    assert doc["projections"] == json.loads(msgspec.json.encode(expected))
    assert doc["checkpoint"] == json.loads(msgspec.json.encode(expected.checkpoints.last))


def test_schema_covers_every_event_kind(capsys):
    assert main(["--schema"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {t.__name__ for t in CURRENT_TYPES} <= set(doc["$defs"])
    for t in CURRENT_TYPES:  # the kind and version apart, as --json prints them (not the stored tag "<kind>@N")
        props = doc["$defs"][t.__name__]["properties"]
        assert (props["kind"], props["version"]) == ({"const": t.KIND}, {"const": t.VERSION})


def test_plot_writes_a_png(run_dir, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert main([str(run_dir), "plot", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_tensorboard_export_carries_the_history_projection(run_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main([str(run_dir), "export", "--tensorboard", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    history = project(read_events(run_dir)).history.records
    val = [(e.step, e.value) for e in acc.Scalars("epoch/val_loss")]
    assert [s for s, _ in val] == [r.epoch for r in history]
    assert [v for _, v in val] == pytest.approx([r.val["val_loss"] for r in history], rel=1e-6)
    steps = [e.step for e in acc.Scalars("update/loss/sgd")]
    assert steps == list(range(1, history[-1].counters.step + 1))


def test_follow_tails_a_live_run_until_it_finalizes(tmp_path, capsys):
    runs = tmp_path / "runs"
    pid = os.fork()
    if pid == 0:  # the writer
        code = 0
        try:
            from nnx_es import LambdaCallback

            slow = LambdaCallback(on_epoch_end=lambda ctx: time.sleep(0.3))
            net = small_net()
            Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), callbacks=[slow],
                    runs_root=runs, run_id="live", progress=False).fit(*loaders(), epochs=4)
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    deadline = time.time() + 30
    while not (runs / "live" / "events.lmdb" / "data.mdb").exists() and time.time() < deadline:
        time.sleep(0.02)
    assert main([str(runs / "live"), "--follow", "--json", "--kind", "epoch_began,run_finalized"]) == 0
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    rows = _json_lines(capsys)
    assert [r["kind"] for r in rows] == ["epoch_began"] * 4 + ["run_finalized"]
    assert [r["epoch"] for r in rows[:4]] == [0, 1, 2, 3]


def test_inspect_streams_a_long_run_without_loading_it(tmp_path, capsys):
    run = tmp_path / "long"
    n = long_run_log(run / "events.lmdb", 120_000, batches=250)
    tracemalloc.start()
    try:
        assert main([str(run), "--kind", "last_committed", "--json"]) == 0
        assert main([str(run), "summary", "--json"]) == 0
        assert main([str(run), "--at", str(n - 1), "--json"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out.splitlines()
    summary = json.loads(out[-2])
    assert summary["events"] == n and summary["epochs"] == summary["counters"]["epoch"] > 200
    # 120k decoded events would take well over 60 MB; streaming stays at one chunk and one epoch
    assert peak < 30 * 2**20, peak


def test_summary_and_at_read_a_long_log_once_and_its_tail_from_the_end(tmp_path, capsys, monkeypatch):
    run = tmp_path / "long"
    n = long_run_log(run / "events.lmdb", 150_000, batches=250)  # epochs of 509 events
    read = [0]
    chunks, raw = LmdbLog.read_chunks, LmdbLog.read_raw

    def counted_chunks(self, start=0, stop=None):
        for first, values in chunks(self, start, stop):
            read[0] += len(values)
            yield first, values

    def counted_raw(self, start=0, stop=None):
        for pair in raw(self, start, stop):
            read[0] += 1
            yield pair

    monkeypatch.setattr(LmdbLog, "read_chunks", counted_chunks)
    monkeypatch.setattr(LmdbLog, "read_raw", counted_raw)
    for argv, stop in (([str(run), "summary", "--json"], n), ([str(run), "--at", "100000", "--json"], 100_001)):
        read[0] = 0
        assert main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["events"] == stop
        assert stop <= read[0] <= stop + 4 * 1024, (argv, read[0])  # the log once, then a few epochs back
    assert doc["tail"] == tail_length(read_events(run)[:100_001]) > 0


def test_follow_stops_when_the_writer_was_killed(tmp_path, capsys):
    from crashkit import kill_at_event, run_killed

    runs = tmp_path / "runs"

    def train():
        net = small_net()
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=runs,
                run_id="dead", progress=False).fit(*loaders(), epochs=3)

    assert run_killed(train, kill_at_event(20)) == "killed"
    t0 = time.time()
    assert main([str(runs / "dead"), "--follow", "--json", "--kind", "epoch_began"]) == 0
    assert time.time() - t0 < 10
    captured = capsys.readouterr()
    assert "no process writes" in captured.err
    assert [json.loads(line)["kind"] for line in captured.out.splitlines()] == ["epoch_began"]
