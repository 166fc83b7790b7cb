"""Golden event sequences and the durable commit order of whole training runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from events.log import LmdbLog
from events.schema import CallbackFinalized, LastCommitted, RunFailed, RunFinalized
from nnx_es import Callback, EarlyStopping, Monitor, NNModel, Scheduler, Trainer, load_result
from nnx_es import checkpoint
from nnx_es.checkpoint import verify_checkpoint
from nnx_es.errors import CorruptCheckpointError
from nnx_es.lifecycle import IllegalTransitionError
from nnx_es.storage import BlobStore
from projections import project
from trainkit import kinds, loaders, read_events, small_net


class Counting(Callback):
    """A callback with state; records the hooks it saw."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self._name = name
        self.seen = seen
        self.epochs = 0

    @property
    def name(self) -> str:
        return self._name

    def on_train_begin(self, ctx):
        self.seen.append(f"{self._name}.begin")

    def on_epoch_end(self, ctx):
        self.epochs += 1

    def on_train_end(self, ctx):
        self.seen.append(f"{self._name}.end")

    def state_dict(self):
        return {"epochs": self.epochs}


def _trainer(tmp_path: Path, callbacks=(), **kw) -> Trainer:
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
    return Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor=Monitor("val_loss"),
        schedulers=[Scheduler(plateau, name="plateau")], callbacks=list(callbacks),
        runs_root=tmp_path / "runs", run_id="r1", progress=False, **{"keep_last": None, **kw},
    )  # every checkpoint kept: these tests read each one (retention has tests of its own)


def test_two_epoch_run_writes_exactly_the_lifecycle_event_sequence(tmp_path):
    seen: list[str] = []
    trainer = _trainer(tmp_path, callbacks=[Counting("a", seen), Counting("b", seen)])
    train, val = loaders(batch_size=16, n_train=48)  # 3 microbatches per epoch
    run = trainer.fit(train, val, epochs=2)
    assert run.status == "completed"
    decisions = [e for _, e in read_events(run.run_dir) if e.KIND == "monitor_decided"]
    assert [d.improved for d in decisions] == [True, True]  # separable data, falling val loss

    epoch = (
        ["epoch_began"] + ["microbatch_done", "update_committed"] * 3
        + ["validation_done", "epoch_summarized", "monitor_decided", "scheduler_stepped",
           "history_appended", "checkpoint_stored", "last_committed", "best_committed"]
    )
    expected = (
        ["run_started", "callback_began", "callback_began", "train_began", "checkpoint_stored", "last_committed"]
        + epoch + epoch
        + ["callback_finalized", "callback_finalized", "checkpoint_stored", "last_committed", "run_finalized"]
    )
    assert kinds(run.run_dir) == expected
    assert seen == ["a.begin", "b.begin", "b.end", "a.end"]
    # fit returns the run as finalization projected it: the same as rebuilding it from disk
    assert run == load_result(run.run_dir) and run.events == len(expected) and len(run.history) == 2


def test_commit_order_is_history_then_last_then_best_then_callback_checkpoints(tmp_path):
    class Deferred(Callback):
        def checkpoint(self, ctx):
            return f"epoch {ctx.epoch}".encode()

    run = _trainer(tmp_path, callbacks=[Deferred()]).fit(*loaders(), epochs=3)
    events = read_events(run.run_dir)
    for epoch in range(3):
        positions = {
            k: [s for s, e in events if e.KIND == k and (e.record.epoch if k == "history_appended" else e.epoch) == epoch]
            for k in ("history_appended", "last_committed", "callback_checkpointed")
        }
        assert positions["history_appended"][0] < positions["last_committed"][0] < positions["callback_checkpointed"][0]
        best = [s for s, e in events if e.KIND == "best_committed" and e.epoch == epoch]
        if best:
            assert positions["last_committed"][0] < best[0] < positions["callback_checkpointed"][0]
    p = project(events)
    assert [r.epoch for r in p.history.records] == [0, 1, 2]
    assert set(p.checkpoints.callbacks) == {"Deferred"}


def test_last_commit_is_synced_and_each_epoch_costs_one_commit_sync(tmp_path):
    trainer = _trainer(tmp_path)
    run = trainer.fit(*loaders(), epochs=3)
    # initial LAST + one per epoch + final LAST + run_finalized, nothing else synced
    assert trainer.recorder.log.syncs == 1 + 3 + 1 + 1
    assert run.last.epoch == 2


def test_finalization_runs_in_reverse_order_and_refreshes_last_after_it(tmp_path):
    seen: list[str] = []

    class Mutating(Counting):
        def on_train_end(self, ctx):
            super().on_train_end(ctx)
            self.epochs = 100  # a mutation at finalization must reach the persisted checkpoint

    cbs = [Mutating("first", seen), Counting("second", seen), Counting("third", seen)]
    run = _trainer(tmp_path, callbacks=cbs).fit(*loaders(), epochs=1)
    events = read_events(run.run_dir)
    fin = [e for _, e in events if isinstance(e, CallbackFinalized)]
    assert [(e.name, e.index) for e in fin] == [("third", 2), ("second", 1), ("first", 0)]
    assert seen[-3:] == ["third.end", "second.end", "first.end"]
    last = [e for _, e in events if isinstance(e, LastCommitted)][-1]
    assert last.final is True
    from nnx_es.checkpoint import load_component

    store = BlobStore(Path(run.run_dir) / "blobs")
    manifest = verify_checkpoint(store, last.manifest)
    assert load_component(store, manifest, "callback/first") == {"epochs": 100}


@pytest.mark.parametrize("finalizer", [None, "callback", "stage", "instance", "subclass"])
def test_the_final_last_is_captured_again_only_when_finalization_could_change_the_state(tmp_path, finalizer):
    from nnx_es import LambdaCallback
    from nnx_es.stages import TrainingStage

    class AfterTraining:
        stage = TrainingStage.AFTER_TRAINING
        frequency = 1

        def __call__(self, ctx, stage):
            with torch.no_grad():
                next(ctx.net.parameters()).add_(1.0)  # a change the final LAST must hold

    def mutate(ctx):
        with torch.no_grad():
            next(ctx.net.parameters()).add_(1.0)  # a change the final LAST must hold

    class Subclassed(Callback):
        def on_train_end(self, ctx):
            mutate(ctx)

    on_instance = Callback()
    on_instance.on_train_end = mutate  # assigned on the instance: still run at finalization
    callbacks = {"callback": [LambdaCallback(on_train_end=mutate)], "instance": [on_instance],
                 "subclass": [Subclassed()]}.get(finalizer, [])
    hooks = [AfterTraining()] if finalizer == "stage" else []
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      callbacks=callbacks, hooks=hooks, runs_root=tmp_path / "runs", run_id="f", progress=False,
                      keep_last=None)  # the sequence at the end is the subject, not retention
    run = trainer.fit(loaders()[0], epochs=2)
    events = [e for _, e in read_events(run.run_dir)]
    lasts = [e for e in events if isinstance(e, LastCommitted)]
    assert lasts[-1].final and lasts[-1].counters == lasts[-2].counters == run.counters
    if finalizer is None:  # nothing ran after the epoch's commit: the same checkpoint, named again
        assert lasts[-1].manifest == lasts[-2].manifest
        assert [e.KIND for e in events[-3:]] == ["last_committed", "last_committed", "run_finalized"]
    else:
        assert [e.KIND for e in events[-3:]] == ["checkpoint_stored", "last_committed", "run_finalized"]
    store = BlobStore(Path(run.run_dir) / "blobs")
    from nnx_es.checkpoint import load_component

    saved = load_component(store, verify_checkpoint(store, lasts[-1].manifest), "model")
    assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())


def test_a_cleanup_error_does_not_mask_the_training_error(tmp_path):
    seen: list[str] = []

    class Boom(Callback):
        def on_epoch_end(self, ctx):
            raise KeyError("training broke")

    class BadCleanup(Counting):
        def on_train_end(self, ctx):
            super().on_train_end(ctx)
            raise RuntimeError("cleanup broke")

    cbs = [Counting("ok1", seen), BadCleanup("bad", seen), Boom(), Counting("ok2", seen)]
    with pytest.raises(KeyError, match="training broke"):
        _trainer(tmp_path, callbacks=cbs).fit(*loaders(), epochs=2)
    # every cleanup hook ran, in reverse order, despite the failing one
    assert seen[-3:] == ["ok2.end", "bad.end", "ok1.end"]
    events = read_events(tmp_path / "runs" / "r1")
    failed = [e for _, e in events if isinstance(e, RunFailed)]
    assert len(failed) == 1 and failed[0].error_type == "KeyError"
    fin = {e.name: e.error for _, e in events if isinstance(e, CallbackFinalized)}
    assert fin["bad"] is not None and "cleanup broke" in fin["bad"]
    assert fin["ok1"] is None and fin["ok2"] is None
    assert isinstance(events[-1][1], RunFinalized) and events[-1][1].status == "failed"
    result = load_result(tmp_path / "runs" / "r1")
    assert result.status == "failed"
    # the failing epoch never committed: history ends before it
    assert [r.epoch for r in result.history] == []


def test_only_callbacks_whose_begin_completed_are_finalized(tmp_path):
    seen: list[str] = []

    class BadBegin(Counting):
        def on_train_begin(self, ctx):
            raise ValueError("begin broke")

    cbs = [Counting("first", seen), BadBegin("second", seen), Counting("third", seen)]
    with pytest.raises(ValueError, match="begin broke"):
        _trainer(tmp_path, callbacks=cbs).fit(*loaders(), epochs=1)
    assert seen == ["first.begin", "first.end"]
    fin = [e.name for _, e in read_events(tmp_path / "runs" / "r1") if isinstance(e, CallbackFinalized)]
    assert fin == ["first"]


def test_a_corrupted_blob_is_detected_by_its_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "INLINE_MAX", 0)  # the model in a blob file, as a big model is
    run = _trainer(tmp_path).fit(*loaders(), epochs=1)
    store = BlobStore(Path(run.run_dir) / "blobs")
    manifest = verify_checkpoint(store, run.last.manifest)
    victim = store.path(manifest.components["model"].blob)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=manifest.components["model"].blob):
        verify_checkpoint(store, run.last.manifest)
    model = NNModel(small_net())
    with pytest.raises(CorruptCheckpointError):
        model.load(run.run_dir, "last")


def test_an_illegal_transition_is_refused_and_nothing_is_appended(tmp_path):
    from events.schema import EpochBegan
    from nnx_es.runtime.recording import Recorder

    with LmdbLog(tmp_path / "ev") as log:
        rec = Recorder(log)
        with pytest.raises(IllegalTransitionError, match="'epoch_began'.*'new'"):
            rec.emit(EpochBegan(epoch=0))
        assert log.next_seq == 0 and rec.lifecycle.state == "new"


def test_early_stopping_and_best_follow_one_monitor_decision(tmp_path):
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # nothing improves after epoch 0
    trainer = Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=[EarlyStopping(patience=2)],
        runs_root=tmp_path / "runs", run_id="es", progress=False,
    )
    run = trainer.fit(*loaders(), epochs=10)
    assert run.status == "stopped"
    events = read_events(run.run_dir)
    decided = [e for _, e in events if e.KIND == "monitor_decided"]
    assert [d.improved for d in decided] == [True, False, False]
    assert [e.epoch for _, e in events if e.KIND == "best_committed"] == [0]
    stop = [e for _, e in events if e.KIND == "stop_requested"]
    assert len(stop) == 1 and stop[0].reason == "early_stopping" and stop[0].epoch == 2
    assert run.best.epoch == 0 and len(run.history) == 3


def test_a_continuation_never_writes_into_an_existing_run(tmp_path):
    _trainer(tmp_path).fit(*loaders(), epochs=1)
    before = kinds(tmp_path / "runs" / "r1")
    with pytest.raises(Exception, match="already has an event log"):
        _trainer(tmp_path).fit(*loaders(), epochs=1)
    assert kinds(tmp_path / "runs" / "r1") == before


def test_nnmodel_predict_proba_shapes_and_normalization(tmp_path):
    model = NNModel(small_net())
    train, val = loaders()
    run = model.train(train, val, epochs=2, runs_root=tmp_path / "runs", run_id="m", progress=False)
    x = torch.randn(5, 4)
    p = model.predict_proba(x)
    assert p.shape == (5, 3) and p.dtype == torch.float32
    assert torch.allclose(p.sum(dim=1), torch.ones(5))
    assert model.predict(x).shape == (5,)
    assert run.best is not None



@pytest.mark.parametrize("lag", [3, "epoch"])
def test_a_deferred_last_lands_where_declared_and_changes_nothing_committed(tmp_path, lag):
    import msgspec

    from nnx_es.audit import audit_run

    def run(run_id, checkpoint_lag):
        net = small_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        t = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=tmp_path / "runs",
                    run_id=run_id, progress=False, checkpoint_lag=checkpoint_lag, keep_last=None)
        return t, t.fit(*loaders(batch_size=8, n_train=48), epochs=3)  # 6 updates per epoch

    sync_t, sync = run("sync", 0)
    lag_t, lagged = run("lag", lag)
    for k, v in sync_t.net.state_dict().items():
        assert torch.equal(v, lag_t.net.state_dict()[k])
    strip = [msgspec.structs.replace(r, wall_time_s=0.0) for r in sync.history]
    assert strip == [msgspec.structs.replace(r, wall_time_s=0.0) for r in lagged.history]
    events = read_events(lagged.run_dir)
    # the opening LAST (epoch -1) is deferred into epoch 0 too and covers the opening events only
    opening = next(e for _, e in events if e.KIND == "last_committed")
    assert opening.epoch == -1 and opening.covers == next(s for s, e in events if e.KIND == "train_began")
    for epoch in (-1, 0, 1):
        last = next(s for s, e in events if e.KIND == "last_committed" and e.epoch == epoch)
        began = next(s for s, e in events if e.KIND == "epoch_began" and e.epoch == epoch + 1)
        updates_between = sum(1 for s, e in events if began < s < last and e.KIND == "update_committed")
        assert updates_between == (3 if lag == 3 else 6)
        if lag == "epoch":  # right before the next epoch's history
            nxt = next(s for s, e in events if e.KIND == "history_appended" and e.record.epoch == epoch + 1)
            assert [e.KIND for _, e in events[last + 1: nxt]] == ["best_committed"] * (nxt - last - 1) * (epoch >= 0)
    assert audit_run(lagged.run_dir).ok
    with pytest.raises(Exception, match="checkpoint_lag"):
        net = small_net()
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), checkpoint_lag=-1)


def test_declared_accuracy_is_the_exact_share_of_correct_rows_and_undeclared_costs_nothing(tmp_path):
    from trainkit import blobs_data

    x, y = blobs_data(72, seed=3)
    train = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)]
    val = [(x[48:], y[48:])]
    net = small_net(4)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the net never changes: a fixed reference
    run = Trainer(net, opt, nn.CrossEntropyLoss(), metrics=["accuracy"], runs_root=tmp_path / "runs", run_id="acc",
                  progress=False).fit(train, val, epochs=1)
    with torch.no_grad():
        train_hits = (net(x[:48]).argmax(-1) == y[:48]).sum().item()
        val_hits = (net(x[48:]).argmax(-1) == y[48:]).sum().item()
    (record,) = run.history
    assert record.train["accuracy"] == train_hits / 48
    assert record.val["val_accuracy"] == val_hits / 24
    net2 = small_net(4)
    plain = Trainer(net2, torch.optim.SGD(net2.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                    runs_root=tmp_path / "runs", run_id="plain", progress=False).fit(train, val, epochs=1)
    assert "accuracy" not in plain.history[0].train and "val_accuracy" not in plain.history[0].val
    with pytest.raises(Exception, match="unknown metrics.*'f1'"):
        Trainer(net2, torch.optim.SGD(net2.parameters(), lr=0.1), nn.CrossEntropyLoss(), metrics=["f1"])


def test_the_built_in_accuracy_under_its_own_key_is_the_built_in_and_under_another_key_is_refused_saying_so(tmp_path):
    # a fresh user wrote metrics={"accuracy": "accuracy"}: refused with "a metric is a name ('accuracy') ..., got 'accuracy'"
    from nnx_es.errors import ConfigError
    from trainkit import blobs_data

    x, y = blobs_data(48, seed=0)
    runs = []
    for metrics in (["accuracy"], {"accuracy": "accuracy"}):
        net = small_net(4)
        runs.append(Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), metrics=metrics,
                            runs_root=tmp_path / "runs", progress=False).fit([(x, y)], [(x, y)], epochs=1))
    assert runs[0].history[0].train["accuracy"] == runs[1].history[0].train["accuracy"]
    assert runs[0].history[0].val == runs[1].history[0].val and "val_accuracy" in runs[1].history[0].val
    net = small_net(4)
    with pytest.raises(ConfigError, match=r"metrics=\{'acc': 'accuracy'\}: the built-in 'accuracy' is reported under "
                                          r"its own name .* write metrics=\{'accuracy': 'accuracy'\} or \['accuracy'\]"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), metrics={"acc": "accuracy"})


def test_a_resume_after_a_deferred_last_records_the_pending_events_it_abandons(tmp_path):
    from nnx_es import LambdaCallback
    from projections import committed

    def boom(ctx):
        if ctx.epoch == 1 and ctx.batch_index == 4:
            raise RuntimeError("injected")

    def trainer(callbacks=()):
        net = small_net(2)
        return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                       callbacks=list(callbacks), runs_root=tmp_path / "runs", run_id=None if not callbacks else "d",
                       progress=False, checkpoint_lag=2)

    with pytest.raises(RuntimeError, match="injected"):
        trainer([LambdaCallback(name="boom", on_batch_end=boom)]).fit(loaders(batch_size=8)[0], epochs=3)
    run_dir = tmp_path / "runs" / "d"
    before = read_events(run_dir)
    last0 = next(s for s, e in before if e.KIND == "last_committed" and e.epoch == 0)
    began1 = next(s for s, e in before if e.KIND == "epoch_began" and e.epoch == 1)
    assert began1 < last0  # LAST(0) landed two updates into epoch 1, leaving them pending
    resumed = trainer([LambdaCallback(name="boom", on_batch_end=lambda ctx: None)])
    resumed.fit(loaders(batch_size=8)[0], epochs=3, resume_from=run_dir)
    (r,) = [e for _, e in read_events(run_dir) if e.KIND == "run_resumed"]
    kept = {s for s, _ in committed(before)}
    assert r.discard_from == began1 == min(s for s, _ in before if s not in kept)
    assert r.discard_to == len(before)


def test_a_samplers_own_generator_is_checkpointed_and_a_resume_is_exact(tmp_path):
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from nnx_es import LambdaCallback
    from nnx_es.errors import ResumeError
    from trainkit import blobs_data

    x, y = blobs_data(40, seed=5)
    ds = TensorDataset(x, y)

    def loader(own_generator: bool = True):
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(9) if own_generator else None)
        return DataLoader(ds, batch_size=8, sampler=sampler)

    def trainer(run_id, fail=False):
        def boom(ctx):
            if fail and ctx.epoch == 2 and ctx.batch_index == 1:
                raise RuntimeError("injected")
        net = small_net(1)
        return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                       callbacks=[LambdaCallback(name="boom", on_batch_end=boom)],
                       runs_root=tmp_path / "runs", run_id=run_id, progress=False)

    reference = trainer("ref")
    reference.fit(loader(), epochs=4)
    with pytest.raises(RuntimeError, match="injected"):
        trainer("cut", fail=True).fit(loader(), epochs=4)
    for other in (loader(own_generator=False),  # without the sampler's generator
                  DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=torch.Generator()),
                             generator=torch.Generator())):  # with a DataLoader generator the run had not
        refused = trainer(None)
        before = {k: v.clone() for k, v in refused.net.state_dict().items()}
        with pytest.raises(ResumeError, match="cannot restore the data order"):
            refused.fit(other, epochs=4, resume_from=tmp_path / "runs" / "cut")
        assert all(torch.equal(v, refused.net.state_dict()[k]) for k, v in before.items())  # nothing applied
    resumed = trainer(None)
    resumed.fit(loader(), epochs=4, resume_from=tmp_path / "runs" / "cut")  # a fresh loader, same seeds
    for k, v in reference.net.state_dict().items():
        assert torch.equal(v, resumed.net.state_dict()[k]), k
