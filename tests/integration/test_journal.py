"""The history journal: per-row records as content-addressed chunks, published before LAST."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Callback, ConfigError, HistoryJournal, LambdaCallback, Trainer, read_rows, with_row_ids
from nnx_es.audit import audit_run
from nnx_es.rows import VALUES
from trainkit import blobs_data, of_kind, small_net

N_TRAIN, N_VAL = 30, 14


def _loaders():
    x, y = blobs_data(N_TRAIN + N_VAL, 0)
    train = DataLoader(with_row_ids(TensorDataset(x[:N_TRAIN], y[:N_TRAIN])), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    val = DataLoader(with_row_ids(TensorDataset(x[N_TRAIN:], y[N_TRAIN:])), batch_size=5)
    return train, val


def _trainer(root, run_id="r", *, window=2, chunk_rows=7, callbacks=(), journal=True, **kw):
    net = small_net(0)
    history = HistoryJournal(window=window, chunk_rows=chunk_rows) if journal else None
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=root,
                   run_id=run_id, progress=False, callbacks=list(callbacks), history=history, **kw)


def _columns(view):
    c = view.columns()
    return {k: v.tolist() for k, v in c.items()}


def _files(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "lock.mdb"}  # readers write the lock file


def test_the_journal_holds_what_the_log_would_chunked_and_indexed(tmp_path):
    train, val = _loaders()
    t1 = _trainer(tmp_path, "journal")
    t1.fit(train, val, epochs=3)
    train, val = _loaders()
    t2 = _trainer(tmp_path, "log", journal=False)
    t2.fit(train, val, epochs=3)
    in_journal, in_log = read_rows(t1.run_dir), read_rows(t2.run_dir)
    assert _columns(in_journal) == _columns(in_log)  # the same records, bitwise, either way
    assert of_kind(t1.run_dir, "rows_recorded") == [] and of_kind(t2.run_dir, "journal_published") == []
    published = of_kind(t1.run_dir, "journal_published")
    assert [(p.epoch, p.rows, p.chunks) for p in published] == [(e, N_TRAIN + N_VAL, 5 + 2) for e in range(3)]
    assert [p.previous for p in published] == ["", published[0].manifest, published[1].manifest]
    assert in_journal.row(22, "train") == in_log.row(22, "train")  # a row found through the chunk index
    assert audit_run(t1.run_dir).ok


def test_memory_holds_at_most_the_window_and_the_default_callback_sees_it(tmp_path):
    seen = []
    train, val = _loaders()
    trainer = _trainer(tmp_path, window=2)
    trainer.callbacks.append(LambdaCallback(on_epoch_end=lambda ctx: seen.append(
        (ctx.idps.epochs, trainer.rows.memory_bytes))))
    trainer.fit(train, val, epochs=5)
    epoch_bytes = (N_TRAIN + N_VAL) * (8 + 4 * len(VALUES))
    assert seen == [((0,), epoch_bytes), ((0, 1), 2 * epoch_bytes), ((1, 2), 2 * epoch_bytes),
                    ((2, 3), 2 * epoch_bytes), ((3, 4), 2 * epoch_bytes)]
    assert read_rows(trainer.run_dir).epochs == (0, 1, 2, 3, 4)  # the journal has every epoch


class FullHistory(Callback):
    history_access = "full"

    def __init__(self) -> None:
        self.seen = []

    def on_epoch_end(self, ctx) -> None:
        self.seen.append((ctx.idps.epochs, ctx.idps.columns("train")["loss"].tolist()))


def test_a_full_access_callback_reads_the_whole_history_the_others_the_window(tmp_path):
    full = FullHistory()
    windowed = []
    train, val = _loaders()
    trainer = _trainer(tmp_path, window=1, callbacks=[full, LambdaCallback(
        on_epoch_end=lambda ctx: windowed.append(ctx.idps.epochs))])
    trainer.fit(train, val, epochs=3)
    assert windowed == [(0,), (1,), (2,)]
    assert [epochs for epochs, _ in full.seen] == [(0,), (0, 1), (0, 1, 2)]
    # what it read at epoch 2 is the committed history plus epoch 2: the run's records, bitwise
    assert full.seen[-1][1] == read_rows(trainer.run_dir).columns("train")["loss"].tolist()


def test_history_access_must_be_window_or_full(tmp_path):
    class Odd(Callback):
        history_access = "everything"

    with pytest.raises(ConfigError, match=r"history_access='everything'; expected one of \('window', 'full'\)"):
        _trainer(tmp_path, callbacks=[Odd()])


@pytest.mark.parametrize("kw", [{"window": 0}, {"chunk_rows": 0}, {"window": 1.5}, {"chunk_rows": True}])
def test_a_journal_refuses_a_window_or_chunk_size_below_one(kw):
    with pytest.raises(ConfigError, match=r"HistoryJournal\((window|chunk_rows)=\.\.\.\) must be an int >= 1"):
        HistoryJournal(**kw)


def test_readers_stop_at_last_a_failed_last_leaves_the_previous_manifest(tmp_path, monkeypatch):
    import nnx_es.runtime.commit as commit
    from nnx_es.errors import CheckpointWriteError

    real = commit.encode_checkpoint

    def failing(store, **kw):
        if kw["epoch"] == 1:
            raise CheckpointWriteError("injected: the disk is full")
        return real(store, **kw)

    monkeypatch.setattr(commit, "encode_checkpoint", failing)
    train, val = _loaders()
    trainer = _trainer(tmp_path)
    with pytest.raises(CheckpointWriteError):
        trainer.fit(train, val, epochs=3)
    published = of_kind(trainer.run_dir, "journal_published")
    assert [p.epoch for p in published] == [0, 1]  # epoch 1's manifest was written and published...
    assert read_rows(trainer.run_dir).epochs == (0,)  # ...but its LAST failed: readers show epoch 0 only
    assert audit_run(trainer.run_dir).ok
    # the resume publishes epoch 1 again, chained to the last committed manifest (epoch 0's)
    monkeypatch.setattr(commit, "encode_checkpoint", real)
    train, val = _loaders()
    _trainer(tmp_path).fit(train, val, epochs=3, resume_from=trainer.run_dir)
    committed = [p for p in of_kind(trainer.run_dir, "journal_published")][2:]
    assert [p.epoch for p in committed] == [1, 2] and committed[0].previous == published[0].manifest
    assert read_rows(trainer.run_dir).epochs == (0, 1, 2)
    assert audit_run(trainer.run_dir).ok


def test_a_continuation_writes_its_own_chunks_never_its_sources(tmp_path):
    train, val = _loaders()
    source = _trainer(tmp_path, "source")
    source.fit(train, val, epochs=2)
    before = _files(source.run_dir)
    source_rows = _columns(read_rows(source.run_dir))
    train, val = _loaders()
    fork = _trainer(tmp_path, "fork")
    fork.fit(train, val, epochs=2, resume_from=source.run_dir, resume_mode="fork")
    assert _files(source.run_dir) == before  # not a byte of the source changed
    assert _columns(read_rows(source.run_dir)) == source_rows
    view = read_rows(fork.run_dir)
    assert view.epochs == (0, 1)  # the fork's own epochs only
    for p in of_kind(fork.run_dir, "journal_published"):
        assert (fork.run_dir / "blobs" / "sha256" / p.manifest).is_file()
    assert audit_run(fork.run_dir).ok


def test_replay_names_a_damaged_chunk(tmp_path):
    train, val = _loaders()
    trainer = _trainer(tmp_path)
    trainer.fit(train, val, epochs=2)
    from nnx_es.rows.journal import read_manifest
    from nnx_es.storage import BlobStore

    manifest = read_manifest(BlobStore(trainer.run_dir / "blobs"), of_kind(trainer.run_dir, "journal_published")[1].manifest)
    chunk = trainer.run_dir / "blobs" / "sha256" / manifest.parts[0].chunks[1].blob
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = audit_run(trainer.run_dir)
    assert not report.ok
    assert any("history journal of epoch 1 does not verify" in v.message and manifest.parts[0].chunks[1].blob
               in v.message for v in report.violations)


def test_a_stateful_resume_reloads_the_window_from_the_journal(tmp_path):
    seen = []
    train, val = _loaders()
    _trainer(tmp_path, window=2).fit(train, val, epochs=2)
    train, val = _loaders()
    resumed = _trainer(tmp_path, window=2, callbacks=[LambdaCallback(on_epoch_end=lambda ctx: seen.append(
        ctx.idps.epochs))])
    resumed.fit(train, val, epochs=4, resume_from=tmp_path / "r")
    assert seen == [(1, 2), (2, 3)]
    assert read_rows(tmp_path / "r").epochs == (0, 1, 2, 3)
    assert audit_run(tmp_path / "r").ok


def test_the_records_of_a_journal_run_are_float32_columns_indexed_by_row_id(tmp_path):
    train, val = _loaders()
    trainer = _trainer(tmp_path, chunk_rows=4)
    trainer.fit(train, val, epochs=1)
    c = read_rows(trainer.run_dir).columns("train")
    assert c["row_id"].tolist() == list(range(N_TRAIN))
    assert all(c[v].dtype == np.float32 for v in VALUES)


@pytest.mark.parametrize("lag", [2, "epoch"])
def test_a_deferred_last_commits_the_journal_it_covers(tmp_path, lag):
    train, val = _loaders()
    trainer = _trainer(tmp_path, checkpoint_lag=lag)
    trainer.fit(train, val, epochs=3)
    assert read_rows(trainer.run_dir).epochs == (0, 1, 2)
    train, val = _loaders()
    plain = _trainer(tmp_path, "plain")
    plain.fit(train, val, epochs=3)
    assert _columns(read_rows(trainer.run_dir)) == _columns(read_rows(plain.run_dir))
    assert audit_run(trainer.run_dir).ok


def test_a_full_history_callback_on_every_rank_with_a_journal_is_refused_under_ddp_before_training():
    # under DDP only the writer holds the journal's chunks (per-row records themselves are accepted there:
    # tests/distributed/test_rows_ddp.py)
    from nnx_es import Callback
    from nnx_es.distributed.roles import check_declared

    class Reads(Callback):
        distributed = "all"
        history_access = "full"

    with pytest.raises(ConfigError, match=r"history_access='full'\) on every rank.*distributed = 'writer'"):
        check_declared([Reads()], HistoryJournal(1, 8))
    check_declared([Reads()], None)  # the records in memory: every rank holds them
    Reads.distributed = "writer"
    check_declared([Reads()], HistoryJournal(1, 8))


def test_inspect_rows_and_the_data_map_of_a_damaged_chunk_say_so_without_a_traceback(tmp_path, capsys):
    # found in review: `inspect RUN rows` over a corrupt journal chunk ended in a traceback
    from nnx_es.cli.inspect import main
    from nnx_es.rows.journal import read_manifest
    from nnx_es.storage import BlobStore

    train, val = _loaders()
    trainer = _trainer(tmp_path)
    trainer.fit(train, val, epochs=2)
    manifest = read_manifest(BlobStore(trainer.run_dir / "blobs"), of_kind(trainer.run_dir, "journal_published")[1].manifest)
    chunk = trainer.run_dir / "blobs" / "sha256" / manifest.parts[0].chunks[1].blob
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([str(trainer.run_dir), "rows"]) == 2
    err = capsys.readouterr().err
    assert manifest.parts[0].chunks[1].blob in err and "tools/replay" in err and "Traceback" not in err
    assert main([str(trainer.run_dir), "plot", "cartography", "--out", str(tmp_path / "map.png")]) == 2
    err = capsys.readouterr().err
    assert manifest.parts[0].chunks[1].blob in err and "tools/replay" in err
    assert not (tmp_path / "map.png").exists()
