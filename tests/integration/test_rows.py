"""Per-row records ("idps"): every row's loss, prediction and target, keyed by (row id, epoch)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import ConfigError, LambdaCallback, Trainer, read_rows, with_row_ids
from nnx_es.audit import audit_run
from nnx_es.rows import VALUES
from trainkit import blobs_data, of_kind, small_net

N_TRAIN, N_VAL = 30, 14


def _data(seed: int = 0):
    x, y = blobs_data(N_TRAIN + N_VAL, seed)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def _loaders(shuffle: bool = True, batch_size: int = 8):
    (xt, yt), (xv, yv) = _data()
    train = DataLoader(with_row_ids(TensorDataset(xt, yt)), batch_size=batch_size, shuffle=shuffle,
                       generator=torch.Generator().manual_seed(1))
    val = DataLoader(with_row_ids(TensorDataset(xv, yv)), batch_size=5)
    return train, val


def _trainer(tmp_path, run_id="r", *, lr=0.1, callbacks=(), **kw):
    net = small_net(0)
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=lr), nn.CrossEntropyLoss(), runs_root=tmp_path,
                   run_id=run_id, progress=False, callbacks=list(callbacks), metrics=["accuracy"], **kw)


def _per_row(net, x, y, batch_size):
    """Loss, prediction, confidence of each row, computed batch by batch as validation does."""
    net.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = net(x[i:i + batch_size])
            loss = nn.functional.cross_entropy(logits, y[i:i + batch_size], reduction="none")
            conf = torch.log_softmax(logits, -1).gather(1, y[i:i + batch_size, None])[:, 0].exp()
            out.append(torch.stack([loss, logits.argmax(-1).float(), y[i:i + batch_size].float(), conf,
                                    (logits.argmax(-1) == y[i:i + batch_size]).float()]))
    net.train()
    return torch.cat(out, 1).numpy()


def test_every_row_is_recorded_once_per_epoch_keyed_by_row_id_not_batch_position(tmp_path):
    train, val = _loaders(shuffle=True)
    trainer = _trainer(tmp_path)
    trainer.fit(train, val, epochs=3)
    view = read_rows(trainer.run_dir)
    assert view.epochs == (0, 1, 2)
    for epoch in range(3):
        for split, n in (("train", N_TRAIN), ("val", N_VAL)):
            c = view.columns(split, epochs=[epoch])
            assert c["row_id"].tolist() == list(range(n))  # each row once, sorted by id (the loader shuffles)
            assert set(c["epoch"].tolist()) == {epoch} and set(c["split"].tolist()) == {split}
            assert c["row_id"].dtype == np.int64 and all(c[v].dtype == np.float32 for v in VALUES)
    # the last epoch's validation scored the final weights: its records are those rows' values, bitwise
    (_, _), (xv, yv) = _data()
    want = _per_row(trainer.net, xv, yv, batch_size=5)
    got = view.columns("val", epochs=[2])
    np.testing.assert_array_equal(np.stack([got[v] for v in VALUES]), want)
    # the records agree with the epoch's summary: mean loss and accuracy over the rows
    summaries = {s.epoch: s.metrics for s in of_kind(trainer.run_dir, "validation_done")}
    for epoch in range(3):
        c = view.columns("val", epochs=[epoch])
        assert math.isclose(float(c["loss"].astype(np.float64).mean()), summaries[epoch]["val_loss"], rel_tol=1e-6)
        assert int(c["correct"].sum()) / N_VAL == summaries[epoch]["val_accuracy"]
    assert audit_run(trainer.run_dir).ok


def test_training_records_are_each_rows_loss_before_the_update_whatever_its_batch(tmp_path):
    # lr=0: the weights never change, so each row's training loss is its loss under the initial weights,
    # wherever the shuffle put it
    train, val = _loaders(shuffle=True)
    trainer = _trainer(tmp_path, lr=0.0)
    initial = small_net(0)
    trainer.fit(train, epochs=2)
    (xt, yt), _ = _data()
    want = _per_row(initial, xt, yt, batch_size=N_TRAIN)
    view = read_rows(trainer.run_dir)
    for epoch in (0, 1):
        c = view.columns("train", epochs=[epoch])
        np.testing.assert_allclose(np.stack([c[v] for v in VALUES]), want, rtol=1e-6, atol=1e-7)
    assert view.columns("val")["row_id"].size == 0  # no validation loader: no validation records


def test_rows_and_columns_are_the_same_records(tmp_path):
    train, val = _loaders()
    trainer = _trainer(tmp_path)
    trainer.fit(train, val, epochs=2)
    view = read_rows(trainer.run_dir)
    rows = view.rows()
    c = view.columns()
    assert len(rows) == len(view) == 2 * (N_TRAIN + N_VAL) == c["row_id"].size
    for i in (0, 17, len(rows) - 1):
        r = rows[i]
        assert (r.row_id, r.epoch, r.split) == (int(c["row_id"][i]), int(c["epoch"][i]), str(c["split"][i]))
        assert [r.loss, r.prediction, r.target, r.confidence, r.correct] == [float(c[v][i]) for v in VALUES]
    by_row = view.row(7, "train")
    assert [r.epoch for r in by_row] == [0, 1] and all(r.row_id == 7 for r in by_row)


def test_callbacks_read_the_epochs_records_as_ctx_idps_from_epoch_end(tmp_path):
    seen = []

    def at_end(ctx):
        v = ctx.idps
        seen.append((v.epochs, v.columns("train", epochs=[ctx.epoch])["row_id"].size,
                     v.columns("val", epochs=[ctx.epoch])["row_id"].size))

    train, val = _loaders()
    trainer = _trainer(tmp_path, callbacks=[LambdaCallback(on_epoch_end=at_end)])
    trainer.fit(train, val, epochs=2)
    assert seen == [((0,), N_TRAIN, N_VAL), ((0, 1), N_TRAIN, N_VAL)]


def test_a_validation_row_scored_twice_in_an_epoch_fails_the_run_naming_it(tmp_path):
    train, _ = _loaders()
    (_, _), (xv, yv) = _data()
    twice = [{"x": xv[:4], "y": yv[:4], "idx": torch.tensor([0, 1, 2, 3])},
             {"x": xv[4:8], "y": yv[4:8], "idx": torch.tensor([4, 5, 3, 6])}]  # row 3 again (a padded shard)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigError, match=r"row id 3 was scored more than once in the val split"):
        trainer.fit(train, twice, epochs=1)
    assert of_kind(trainer.run_dir, "rows_recorded") == []


def test_an_epoch_mixing_batches_with_and_without_row_ids_is_refused(tmp_path):
    (xt, yt), _ = _data()
    mixed = [{"x": xt[:8], "y": yt[:8], "idx": torch.arange(8)}, (xt[8:16], yt[8:16])]
    with pytest.raises(ConfigError, match=r"1 train batches carried no row ids while 1 did"):
        _trainer(tmp_path).fit(mixed, epochs=1)


def test_row_ids_must_be_one_integer_per_row(tmp_path):
    (xt, yt), _ = _data()
    bad = [{"x": xt[:8], "y": yt[:8], "idx": torch.arange(8).float()}]
    with pytest.raises(ConfigError, match=r"row ids \('idx'\) must be integers of shape \(8,\)"):
        _trainer(tmp_path).fit(bad, epochs=1)


def test_a_four_element_batch_carries_weights_and_row_ids_the_loss_recorded_unweighted(tmp_path):
    (xt, yt), _ = _data()
    w = torch.linspace(0.5, 2.0, N_TRAIN)
    ids = torch.arange(100, 100 + N_TRAIN)
    train = DataLoader(TensorDataset(xt, yt, w, ids), batch_size=10)
    trainer = _trainer(tmp_path, lr=0.0, sample_weights=True)
    trainer.fit(train, epochs=1)
    c = read_rows(trainer.run_dir).columns("train")
    assert c["row_id"].tolist() == ids.tolist()
    want = _per_row(small_net(0), xt, yt, batch_size=10)[0]
    np.testing.assert_allclose(c["loss"], want, rtol=1e-6, atol=1e-7)


def test_four_elements_without_declared_weights_are_refused(tmp_path):
    (xt, yt), _ = _data()
    train = DataLoader(TensorDataset(xt, yt, torch.ones(N_TRAIN), torch.arange(N_TRAIN)), batch_size=10)
    with pytest.raises(ConfigError, match=r"four elements .* needs sample_weights=True"):
        _trainer(tmp_path).fit(train, epochs=1)


def test_a_regression_records_its_output_and_no_confidence(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), nn.MSELoss(), runs_root=tmp_path, run_id="r",
                      progress=False)
    trainer.fit(DataLoader(with_row_ids(TensorDataset(x, y)), batch_size=20), epochs=1)
    c = read_rows(trainer.run_dir).columns("train")
    with torch.no_grad():
        out = net(x)[:, 0]
    np.testing.assert_array_equal(c["prediction"], out.numpy())
    np.testing.assert_array_equal(c["target"], y[:, 0].numpy())
    np.testing.assert_array_equal(c["loss"], ((out - y[:, 0]) ** 2).numpy())
    assert np.isnan(c["confidence"]).all() and np.isnan(c["correct"]).all()


def test_outputs_with_several_values_per_row_are_refused_before_backward(tmp_path):
    x = torch.randn(8, 3)
    y = torch.randn(8, 2)
    net = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), runs_root=tmp_path, run_id="r",
                      progress=False)
    with pytest.raises(ConfigError, match=r"one prediction per row.*outputs of shape \(8, 2\)"):
        trainer.fit(DataLoader(with_row_ids(TensorDataset(x, y)), batch_size=8), epochs=1)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_with_row_ids_refuses_what_it_cannot_wrap():
    x, y = torch.randn(4, 2), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigError, match="TensorDataset"):
        with_row_ids([(x, y)])
    with pytest.raises(ConfigError, match=r"int64 tensor of shape \(4,\)"):
        with_row_ids(TensorDataset(x, y), torch.arange(3))
    with pytest.raises(ConfigError, match="unique"):
        with_row_ids(TensorDataset(x, y), torch.tensor([0, 1, 1, 2]))


def test_gathered_row_id_batches_equal_the_dataloaders(tmp_path):
    from nnx_es.data import iterate_batches

    train, _ = _loaders(shuffle=True)
    gathered = list(iterate_batches(train, gather=True))
    train2, _ = _loaders(shuffle=True)
    plain = list(train2)
    assert len(gathered) == len(plain)
    for a, b in zip(gathered, plain):
        assert a.keys() == b.keys() == {"x", "y", "idx"}
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_step_validations_record_nothing_the_epochs_validation_records_once(tmp_path):
    train, val = _loaders()
    trainer = _trainer(tmp_path, validate_every_steps=2)
    trainer.fit(train, val, epochs=1)
    assert len(of_kind(trainer.run_dir, "validation_done")) > 1
    c = read_rows(trainer.run_dir).columns("val")
    assert c["row_id"].tolist() == list(range(N_VAL))


def test_records_of_an_epoch_whose_last_failed_are_not_shown(tmp_path, monkeypatch):
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
    assert {e.epoch for e in of_kind(trainer.run_dir, "rows_recorded")} == {0, 1}  # epoch 1's are in the log...
    assert read_rows(trainer.run_dir).epochs == (0,)  # ...but no LAST commits them


def test_one_logit_under_bce_records_the_probability_of_the_true_label(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    y = (x[:, 0] > 0).float()
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), nn.BCEWithLogitsLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, metrics=["accuracy"])
    trainer.fit(DataLoader(with_row_ids(TensorDataset(x, y[:, None])), batch_size=16), epochs=1)
    c = read_rows(trainer.run_dir).columns("train")
    with torch.no_grad():
        logit = net(x)[:, 0]
    p = torch.sigmoid(logit)
    np.testing.assert_array_equal(c["confidence"], torch.where(y > 0.5, p, 1 - p).numpy())
    np.testing.assert_array_equal(c["prediction"], (logit > 0).float().numpy())
    np.testing.assert_array_equal(c["correct"], ((logit > 0).float() == y).float().numpy())


def test_inspect_lists_a_records_event_by_its_size_not_its_bytes(tmp_path, capsys):
    from nnx_es.cli.inspect import main as inspect_main

    train, val = _loaders()
    trainer = _trainer(tmp_path)
    trainer.fit(train, val, epochs=1)
    assert inspect_main([str(trainer.run_dir), "--kind", "rows_recorded"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1:] for line in lines] == [
        ["rows_recorded", "epoch=0", "split=train", f"rows={N_TRAIN}", "columns=<6>"],
        ["rows_recorded", "epoch=0", "split=val", f"rows={N_VAL}", "columns=<6>"],
    ]


def test_rows_whose_target_the_loss_ignores_are_recorded_unscored(tmp_path):
    """A row whose target is the loss's ignore_index (-100) trains as torch's mean leaves it (out) and is
    recorded with torch's unreduced loss (0), no confidence or correctness (NaN: there is no true label to
    score); cartography folds the scored rows only."""
    from nnx_es.rows.dynamics import cartography

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    y[::4] = -100
    train = [{"x": x[i:i + 8], "y": y[i:i + 8], "idx": torch.arange(i, i + 8)} for i in range(0, 32, 8)]
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False)
    trainer.fit(train, epochs=2)
    c = read_rows(trainer.run_dir).columns("train")
    ignored = c["target"] == -100
    assert int(ignored.sum()) == 2 * 8
    assert np.isnan(c["confidence"][ignored]).all() and np.isnan(c["correct"][ignored]).all()
    assert (c["loss"][ignored] == 0).all()
    assert np.isfinite(c["confidence"][~ignored]).all() and not np.isnan(c["correct"][~ignored]).any()
    state = cartography(read_rows(trainer.run_dir))
    kept = sorted(set(c["row_id"][~ignored].tolist()))
    assert state.row_id[state.epochs > 0].tolist() == kept and (state.epochs[state.epochs > 0] == 2).all()


def test_only_a_plain_tensor_dataset_loader_is_known_to_carry_no_row_ids():
    from nnx_es.rows.dataset import carries_row_ids

    (x, y), _ = _data()
    w, ids = torch.ones(len(y)), torch.arange(len(y))
    assert not carries_row_ids(DataLoader(TensorDataset(x, y), batch_size=8))  # lists of two tensors: never ids
    assert not carries_row_ids(DataLoader(TensorDataset(x, y, w), batch_size=8))
    assert carries_row_ids(DataLoader(TensorDataset(x, y, w, ids), batch_size=8))  # (x, y, w, idx)
    assert carries_row_ids(DataLoader(with_row_ids(TensorDataset(x, y)), batch_size=8))  # {"x", "y", "idx"}
    assert carries_row_ids(DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=lambda rows: rows))
    assert carries_row_ids([(x, y)]) and carries_row_ids(None)


def test_a_loader_of_two_tensors_trains_without_per_row_records(tmp_path):
    (x, y), _ = _data()
    run = _trainer(tmp_path).fit(DataLoader(TensorDataset(x, y), batch_size=8), None, epochs=1)
    assert of_kind(run.run_dir, "rows_recorded") == [] and audit_run(run.run_dir).ok
