"""Materialized views: deterministic bytes, written atomically, read back as found."""

from __future__ import annotations

import json
from pathlib import Path

from helpers_runs import RUN_ID, clean_events

from events.schema import Counters, HistoryAppended, HistoryRecord, RunStarted
from nnx_es.views import HISTORY_CSV, SUMMARY_JSON, expected_views, read_views, write_views
from projections import Projections, fold, project


def _history(*records: HistoryRecord) -> Projections:
    p = fold(Projections(), 0, RunStarted(run_id="v", seed=0))
    for i, r in enumerate(records, start=1):
        p = fold(p, i, HistoryAppended(record=r))
    return p


def test_history_csv_has_one_row_per_record_with_flattened_lrs_and_counters() -> None:
    p = _history(
        HistoryRecord(epoch=0, train={"loss": 0.5}, val={"val_loss": 0.25}, monitor_value=0.25, improved=True,
                      lrs={"sgd": [0.1, 0.01]}, counters=Counters(batch=4, step=2, global_step=2, epoch=1, epoch_step=4),
                      wall_time_s=1.5),
        HistoryRecord(epoch=1, train={"loss": float("nan")}, val={}, lrs={"sgd": [0.05, 0.005]}),
    )
    text = expected_views(p)[HISTORY_CSV].decode()
    assert text.splitlines() == [
        "epoch,loss,val_loss,monitor_value,improved,lr/sgd/0,lr/sgd/1,counters/batch,counters/step,"
        "counters/global_step,counters/epoch,counters/epoch_step,wall_time_s",
        "0,0.5,0.25,0.25,true,0.1,0.01,4,2,2,1,4,1.5",
        "1,nan,,,,0.05,0.005,0,0,0,0,0,0.0",
    ]
    assert text.endswith("\n") and "\r" not in text


def test_floats_keep_full_precision_with_repr() -> None:
    p = _history(HistoryRecord(epoch=0, train={"loss": 0.1 + 0.2}, val={}))
    row = expected_views(p)[HISTORY_CSV].decode().splitlines()[1]
    assert "0.30000000000000004" in row.split(",")


def test_a_training_metric_named_like_another_column_is_prefixed() -> None:
    p = _history(HistoryRecord(epoch=0, train={"epoch": 3.0, "val_loss": 1.0}, val={"val_loss": 2.0}))
    header = expected_views(p)[HISTORY_CSV].decode().splitlines()[0].split(",")
    assert header[:4] == ["epoch", "train/epoch", "train/val_loss", "val_loss"]


def test_summary_json_is_sorted_and_names_pointers_and_schedulers(tmp_path: Path) -> None:
    events, _ = clean_events(tmp_path / "runs" / RUN_ID)
    p = project(enumerate(events))
    raw = expected_views(p)[SUMMARY_JSON]
    doc = json.loads(raw)
    assert list(doc) == sorted(doc)
    assert doc["status"] == "completed" and doc["run_id"] == RUN_ID and doc["epochs"] == 2
    assert doc["last"]["epoch"] == 1 and doc["best"]["epoch"] == 0 and doc["best"]["value"] == 0.8
    assert set(doc["schedulers"]) == {"warmup", "plateau"}
    assert doc["counters"] == {"batch": 8, "step": 3, "global_step": 3, "epoch": 2, "epoch_step": 4}
    assert raw.endswith(b"\n")


def test_views_are_deterministic_and_round_trip(tmp_path: Path) -> None:
    events, _ = clean_events(tmp_path / "runs" / RUN_ID)
    p = project(enumerate(events))
    assert expected_views(p) == expected_views(project(enumerate(events)))
    run_dir = tmp_path / "runs" / RUN_ID
    assert read_views(run_dir) == {}
    write_views(run_dir, p)
    assert read_views(run_dir) == expected_views(p)
    assert not list((run_dir / "views").glob(".*.tmp"))  # no temporary left behind


def test_read_views_returns_only_present_files(tmp_path: Path) -> None:
    write_views(tmp_path, Projections())
    (tmp_path / SUMMARY_JSON).unlink()
    assert set(read_views(tmp_path)) == {HISTORY_CSV}
