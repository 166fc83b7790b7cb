"""Resumes that must be refused up front: another averaging set-up, a source that is not a run.

A refusal restores nothing and writes nothing: the run's log is unchanged, and a run
directory the refused call created itself is gone, so a retry with the right source works.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from events.schema import LastCommitted
from nnx_es import EMA, Callback, NNModel, Trainer
from nnx_es.errors import ConfigError, ResumeError
from trainkit import EpochCounter, loaders, read_events, small_net, write_blob

torch.set_num_threads(1)


def train(runs: Path, epochs: int, hooks: list, *, run_id: str | None = "r", **kw):
    model = NNModel(small_net(0))
    return model.train(*loaders(batch_size=8), epochs=epochs,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), hooks=hooks,
                       runs_root=runs, run_id=run_id, seed=0, progress=False, **kw)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock.mdb"}


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """A two-epoch run with one default-named EMA (its LAST holds ``update_hook/EMA``)."""
    runs = tmp_path_factory.mktemp("ema")
    train(runs, 2, [EMA(0.9)])
    return runs


@pytest.mark.parametrize("hooks, names", [
    ([], "EMA hooks named []"),
    ([EMA(0.9, name="other")], "EMA hooks named ['other']"),
    ([EMA(0.9), EMA(0.9, name="second")], "EMA hooks named ['EMA', 'second']"),
], ids=["left_out", "renamed", "one_added"])
def test_a_stateful_resume_with_another_ema_setup_is_refused_and_writes_nothing(ema_run, tmp_path, hooks, names):
    runs = tmp_path / "runs"
    shutil.copytree(ema_run, runs)
    before = _tree(runs / "r")
    with pytest.raises(ResumeError, match=r"other averaging update hooks.*holds EMA state \['EMA'\]") as err:
        train(runs, 4, hooks, resume_from=runs / "r")
    assert names in str(err.value)
    assert _tree(runs / "r") == before


def test_a_stateful_resume_without_ema_of_a_run_that_had_none_is_refused(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 1, [])
    with pytest.raises(ResumeError, match=r"holds EMA state \[\], this trainer has EMA hooks named \['EMA'\]"):
        train(runs, 2, [EMA(0.9)], resume_from=runs / "r")


def test_a_stateful_resume_with_the_runs_ema_setup_continues(ema_run, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(ema_run, runs)
    run = train(runs, 3, [EMA(0.9)], resume_from=runs / "r")
    assert run.status == "completed" and len(run.history) == 3


def test_a_weights_only_continuation_takes_any_averaging_hooks(ema_run, tmp_path):
    run = train(tmp_path / "runs", 1, [EMA(0.5, name="fresh")], run_id="child", resume_from=ema_run / "r",
                resume_mode="weights_only")
    assert run.status == "completed"


@pytest.mark.parametrize("mode", ["weights_only", "stateful"])
def test_a_refused_continuation_leaves_no_run_directory_and_the_retry_succeeds(tmp_path, mode):
    runs = tmp_path / "runs"
    train(runs, 1, [], run_id="src")
    kw = {"resume_mode": "weights_only", "run_id": "child"} if mode == "weights_only" else {"run_id": None}
    with pytest.raises(ResumeError, match="nothing was restored or written"):
        train(runs, 1, [], resume_from=runs / "typo", **kw)
    assert not (runs / "child").exists() and not (runs / "typo").exists()
    retried = train(runs, 1, [], resume_from=runs / "src", **kw)
    assert retried.status == "completed"


def test_a_weights_only_continuation_from_a_corrupt_source_leaves_no_run_and_the_retry_succeeds(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 1, [], run_id="src")
    train(runs, 1, [], run_id="bad")
    last = [e for _, e in read_events(runs / "bad") if isinstance(e, LastCommitted)][-1]
    write_blob(runs / "bad", last.manifest, b"")
    with pytest.raises(ResumeError, match="refused"):
        train(runs, 1, [], run_id="child", resume_from=runs / "bad", resume_mode="weights_only")
    assert not (runs / "child").exists()
    child = train(runs, 1, [], run_id="child", resume_from=runs / "src", resume_mode="weights_only")
    assert child.status == "completed"


def test_a_refusal_after_the_log_opened_never_removes_a_run_that_existed(ema_run, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(ema_run, runs)
    with pytest.raises(ResumeError):
        train(runs, 4, [], resume_from=runs / "r")
    assert [e.KIND for _, e in read_events(runs / "r")][0] == "run_started"


@pytest.mark.parametrize("mode", ["stateful", "weights_only"])
@pytest.mark.parametrize("what", ["runs_root", "file"])
def test_resume_from_a_path_that_is_not_a_run_directory_says_so(tmp_path, mode, what):
    runs = tmp_path / "runs"
    train(runs, 1, [], run_id="base")
    target = runs if what == "runs_root" else next(p for p in (runs / "base" / "views").rglob("*") if p.is_file())
    with pytest.raises(ResumeError, match="is not a run directory: it has no event log") as err:
        train(runs, 1, [], run_id="base2" if mode == "weights_only" else "base", resume_from=target,
              resume_mode=mode)
    assert str(target) in str(err.value) and "another run" not in str(err.value)
    if what == "runs_root":
        assert "runs root" in str(err.value)


def test_two_emas_with_their_own_names_train_and_resume(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 1, [EMA(0.9, name="fast"), EMA(0.99, name="slow")])
    names = [n for n in read_last_components(runs / "r") if n.startswith("update_hook/")]
    assert names == ["update_hook/fast", "update_hook/slow"]
    run = train(runs, 2, [EMA(0.9, name="fast"), EMA(0.99, name="slow")], resume_from=runs / "r")
    assert len(run.history) == 2
    with pytest.raises(ResumeError, match=r"\['fast', 'slow'\].*\['slow', 'fast'\]"):
        train(runs, 3, [EMA(0.99, name="slow"), EMA(0.9, name="fast")], resume_from=runs / "r")


def read_last_components(run_dir: Path) -> list[str]:
    from events.schema import LastCommitted
    from nnx_es.checkpoint import read_manifest
    from nnx_es.storage import BlobStore

    digest = [e for _, e in read_events(run_dir) if isinstance(e, LastCommitted)][-1].manifest
    return list(read_manifest(BlobStore(run_dir / "blobs"), digest).components)


def test_two_emas_of_one_name_are_refused_with_how_to_name_them():
    net = small_net()
    with pytest.raises(ConfigError, match=r"give each EMA its own name, e.g. EMA\(0.9, name="):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
                hooks=[EMA(0.9), EMA(0.99)])


@pytest.mark.parametrize("name", ["", "a/b", 3, "x" * 65])
def test_an_ema_name_that_cannot_key_a_checkpoint_component_is_refused(name):
    with pytest.raises(ConfigError, match="EMA name must be"):
        EMA(0.9, name=name)


class _Tally(Callback):
    """A stateful callback the run did not have: its state is missing from the checkpoint."""

    def state_dict(self):
        return {"seen": 0}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("change", ["another architecture", "a stateful callback the run lacked"])
def test_a_refused_apply_leaves_the_trainers_net_as_it_was(ema_run, tmp_path, change):
    """Every refusal is decided before any state is applied: load_state_dict alone would copy
    the weights that fit and then raise, or a later missing component would refuse a half-restored net."""
    runs = tmp_path / "runs"
    shutil.copytree(ema_run, runs)
    torch.manual_seed(1)
    net = small_net(0) if change != "another architecture" else torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))  # the first layer fits
    callbacks = [_Tally()] if change != "another architecture" else []
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), hooks=[EMA(0.9)],
                      callbacks=callbacks, monitor="val_loss", metrics=("accuracy",), runs_root=runs, seed=0,
                      progress=False)  # the run's recipe, as NNModel.train declared it
    before = {k: v.clone() for k, v in net.state_dict().items()}
    expected = "does not fit this net.*2.weight" if change == "another architecture" else "no state for callback"
    with pytest.raises(ResumeError, match=expected):
        trainer.fit(*loaders(batch_size=8), epochs=3, resume_from=runs / "r")
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("kw, what", [
    ({"precision": "bf16"}, "UpdateSpec(precision='fp32', clip_grad_norm=None)"),
    ({"clip_grad_norm": 1.0}, "clip_grad_norm=1.0"),
], ids=["precision", "clipping"])
def test_a_stateful_resume_with_another_precision_or_clipping_is_refused_and_writes_nothing(tmp_path, kw, what):
    runs = tmp_path / "runs"
    train(runs, 1, [])
    before = _tree(runs / "r")
    with pytest.raises(ResumeError, match="different precision or gradient clipping") as err:
        train(runs, 3, [], resume_from=runs / "r", **kw)
    assert what in str(err.value)
    assert _tree(runs / "r") == before


def test_a_run_recorded_before_its_update_spec_resumes_with_any(tmp_path):
    import msgspec

    from events.codec import encode
    from events.log import LmdbLog
    from events.schema import RunStarted

    runs = tmp_path / "runs"
    train(runs, 1, [])
    with LmdbLog(runs / "r" / "events.lmdb") as log:
        seq, started = next((s, e) for s, e in log.read() if isinstance(e, RunStarted))
        log.put_raw(seq, encode(msgspec.structs.replace(started, update=None)))  # as an older run wrote it
    run = train(runs, 2, [], resume_from=runs / "r", clip_grad_norm=5.0)
    assert run.status == "completed" and len(run.history) == 2


def test_a_resume_to_fewer_epochs_than_committed_is_refused_and_writes_nothing(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 3, [])
    before = _tree(runs / "r")
    model = NNModel(small_net(0))
    fresh = [p.detach().clone() for p in model.net.parameters()]
    with pytest.raises(ConfigError, match=r"epochs=2 is fewer than the 3 epochs the run already committed"):
        model.train(*loaders(batch_size=8), epochs=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    runs_root=runs, seed=0, progress=False, resume_from=runs / "r")
    assert _tree(runs / "r") == before
    assert all(torch.equal(a, b) for a, b in zip(fresh, model.net.parameters()))  # nothing restored into it
    assert train(runs, 3, [], resume_from=runs / "r").status == "completed"  # as many: nothing left to train


def test_a_resume_through_a_symlink_or_dot_continues_the_run_itself_under_its_own_lease(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    train(runs, 1, [])
    alias = tmp_path / "latest"
    alias.symlink_to(runs / "r", target_is_directory=True)
    run = train(runs, 2, [], run_id=None, resume_from=alias)
    assert run.run_id == "r" and len(run.history) == 2
    assert sorted(p.name for p in (runs / ".leases").iterdir()) == ["r.lock"]  # not a lease of "latest"
    assert not (tmp_path / ".leases").exists()
    monkeypatch.chdir(runs / "r")
    assert train(runs, 3, [], run_id=None, resume_from=".").run_id == "r"


def test_a_refused_resume_leaves_the_trainers_run_identity_as_it_was(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 2, [])
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=tmp_path / "other", progress=False)
    with pytest.raises(ConfigError, match="fewer than the 2 epochs"):
        trainer.fit(*loaders(batch_size=8), epochs=1, resume_from=runs / "r")
    assert (trainer.run_id, trainer.runs_root, trainer.run_dir) == (None, tmp_path / "other", None)
    run = trainer.fit(*loaders(batch_size=8), epochs=1)  # a new run of its own, where it was told
    assert Path(run.run_dir).parent == tmp_path / "other"


def _batch_size_fit(runs: Path, batch_size: int, epochs: int, **kw):
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
                      runs_root=runs, run_id="r", seed=0, progress=False)
    return trainer.fit(*loaders(batch_size=batch_size, n_train=100), epochs=epochs, **kw)


def test_a_stateful_resume_with_another_batch_size_is_refused_naming_old_and_new(tmp_path):
    runs = tmp_path / "runs"
    _batch_size_fit(runs, 20, 1)
    started = next(e for _, e in read_events(runs / "r") if e.KIND == "run_started")
    assert started.loaders["train"].batch_size == 20 and started.loaders["train"].batches_per_epoch == 5
    assert started.loaders["train"].dataset_length == 100 and started.loaders["train"].drop_last is False
    before = _tree(runs / "r")
    with pytest.raises(ResumeError, match=r"train loader's geometry.*batch_size 20 -> 50, batches_per_epoch 5 -> 2"):
        _batch_size_fit(runs, 50, 2, resume_from=runs / "r")
    assert _tree(runs / "r") == before
    assert len(_batch_size_fit(runs, 20, 2, resume_from=runs / "r").history) == 2  # the same geometry resumes


def test_a_run_recorded_without_loader_geometry_resumes_as_before(tmp_path, monkeypatch):
    import nnx_es.trainer

    runs = tmp_path / "runs"
    with monkeypatch.context() as m:  # a run_started as recorded before the geometry was
        m.setattr(nnx_es.trainer, "loader_geometries", lambda loaders: None)
        _batch_size_fit(runs, 20, 1)
    assert next(e for _, e in read_events(runs / "r") if e.KIND == "run_started").loaders is None
    assert len(_batch_size_fit(runs, 50, 2, resume_from=runs / "r").history) == 2


# --- another loss, a dropped stateful callback -------------------------------------------------


@pytest.mark.parametrize("loss", [torch.nn.CrossEntropyLoss(label_smoothing=0.1), torch.nn.NLLLoss(),
                                  torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 1.0]))],
                         ids=["smoothed", "other_class", "class_weighted"])
def test_a_stateful_resume_with_another_loss_is_refused_and_writes_nothing(tmp_path, loss):
    runs = tmp_path / "runs"
    train(runs, 1, [])
    before = _tree(runs / "r")
    if getattr(loss, "weight", None) is not None:  # class weight= is refused at construction anyway
        with pytest.raises(ConfigError, match="weight"):
            train(runs, 2, [], resume_from=runs / "r", loss=loss)
        return
    with pytest.raises(ResumeError, match=r"with a different loss: the run declared \{'loss': 'CrossEntropyLoss\("):
        train(runs, 2, [], resume_from=runs / "r", loss=loss)
    assert _tree(runs / "r") == before
    assert train(runs, 2, [], resume_from=runs / "r").status == "completed"  # the run's own loss continues


def test_a_stateful_resume_without_a_callback_whose_state_last_holds_is_refused(tmp_path):
    runs = tmp_path / "runs"
    train(runs, 1, [], callbacks=[EpochCounter()])
    before = _tree(runs / "r")
    with pytest.raises(ResumeError, match=r"without its callback\(s\) \['EpochCounter'\]"):
        train(runs, 2, [], resume_from=runs / "r")
    assert _tree(runs / "r") == before
    counting = EpochCounter()
    assert train(runs, 2, [], resume_from=runs / "r", callbacks=[counting]).status == "completed"
    assert counting.epochs == 2  # restored (1) and one more epoch
    # a new, stateless callback is welcome on resume
    assert train(runs, 3, [], resume_from=runs / "r", callbacks=[EpochCounter(), Callback()]).status == "completed"


@pytest.mark.parametrize("mode", ["weights_only", "fork"])
@pytest.mark.parametrize("auto", [True, False])
def test_a_resume_mode_without_a_source_is_refused_not_ignored(tmp_path, mode, auto):
    """Found in review: ``resume='auto', resume_mode='weights_only'`` (what the world-size refusal's
    advice reads like) resumed the run statefully, and a mode without ``resume_from`` started a
    fresh run: the mode was dropped silently either way."""
    runs = tmp_path / "runs"
    train(runs, 1, [])
    before = _tree(runs / "r")
    with pytest.raises(ConfigError, match=f"resume_mode='{mode}'.*resume_from=") as err:
        train(runs, 2, [], run_id="r" if auto else "other", resume_mode=mode, **({"resume": "auto"} if auto else {}))
    assert isinstance(err.value, ValueError)
    assert _tree(runs / "r") == before and not (runs / "other").exists()


# --- another history journal ---------------------------------------------------------------------


def _journal_fit(runs: Path, epochs: int, history, **kw):
    from nnx_es.rows import HistoryJournal, with_row_ids

    net = small_net(0)
    train_loader, val_loader = loaders(batch_size=8)
    train_loader = torch.utils.data.DataLoader(with_row_ids(train_loader.dataset), batch_size=8)
    val_loader = torch.utils.data.DataLoader(with_row_ids(val_loader.dataset), batch_size=8)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), runs_root=runs,
                      run_id="r", seed=0, progress=False,
                      history=None if history is None else HistoryJournal(*history))
    return trainer.fit(train_loader, val_loader, epochs=epochs, **kw)


@pytest.mark.parametrize("first, then, said", [
    ((2, 16), None, "'HistoryJournal(window=2, chunk_rows=16)', this trainer has 'none'"),
    (None, (2, 16), "'none', this trainer has 'HistoryJournal(window=2, chunk_rows=16)'"),
    ((2, 16), (2, 8), "'HistoryJournal(window=2, chunk_rows=16)', this trainer has 'HistoryJournal(window=2, "
                      "chunk_rows=8)'"),
], ids=["dropped", "added", "rechunked"])
def test_a_stateful_resume_with_another_history_journal_is_refused_naming_old_and_new(tmp_path, first, then, said):
    import re

    runs = tmp_path / "runs"
    _journal_fit(runs, 1, first)
    started = next(e for _, e in read_events(runs / "r") if e.KIND == "run_started")
    assert started.history == ("none" if first is None else f"HistoryJournal(window={first[0]}, chunk_rows={first[1]})")
    before = _tree(runs / "r")
    with pytest.raises(ResumeError, match=r"different history journal .*the run declared " + re.escape(said)):
        _journal_fit(runs, 2, then, resume_from=runs / "r")
    assert _tree(runs / "r") == before  # refused before training: nothing restored or written
    assert len(_journal_fit(runs, 2, first, resume_from=runs / "r").history) == 2  # the same journal resumes


def test_a_run_recorded_before_the_journal_was_declared_resumes_with_any(tmp_path, monkeypatch):
    import msgspec

    import nnx_es.trainer

    runs = tmp_path / "runs"
    real = nnx_es.trainer.Trainer._declare
    with monkeypatch.context() as m:  # a run_started as recorded before history was declared in it
        m.setattr(nnx_es.trainer.Trainer, "_declare",
                  lambda self, *a: msgspec.structs.replace(real(self, *a), history=None))
        _journal_fit(runs, 1, None)
    assert next(e for _, e in read_events(runs / "r") if e.KIND == "run_started").history is None
    assert len(_journal_fit(runs, 2, (2, 16), resume_from=runs / "r").history) == 2


def _recorded_fit(runs: Path, lr: float, epochs: int, **kw):
    """A trainer that records its spec (``recipe_required=True``): an MLP and SGD at ``lr``."""
    from nnx_es.recipes.models import MLP

    torch.manual_seed(0)
    net = MLP(4, 3, hidden=[8])
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=lr), torch.nn.CrossEntropyLoss(),
                      recipe_required=True, runs_root=runs, run_id="r", seed=0, progress=False)
    return trainer.fit(loaders(batch_size=8)[0], epochs=epochs, **kw)


@pytest.mark.parametrize("mode", ["stateful", "fork"])
def test_a_resume_whose_recorded_spec_has_another_learning_rate_is_refused_naming_it(tmp_path, mode):
    """Its LAST's optimizer state would silently put the run's learning rate back (every update after the
    resume at 0.1, not 0.5); a fork restores the same state."""
    runs = tmp_path / "runs"
    _recorded_fit(runs, 0.1, 1)
    before = _tree(runs / "r")
    kw = {"resume_mode": "fork"} if mode == "fork" else {}
    with pytest.raises(ResumeError) as err:
        _recorded_fit(tmp_path / "forks" if mode == "fork" else runs, 0.5, 2, resume_from=runs / "r", **kw)
    assert "optimizers.sgd.kwargs.lr: 0.1 in the run, 0.5 given" in str(err.value)
    assert "resume_mode='weights_only'" in str(err.value) and "nothing was restored or written" in str(err.value)
    assert _tree(runs / "r") == before


def test_a_resume_whose_recorded_spec_differs_only_in_epochs_continues(tmp_path):
    runs = tmp_path / "runs"
    _recorded_fit(runs, 0.1, 1)
    assert _recorded_fit(runs, 0.1, 2, resume_from=runs / "r").status == "completed"


def test_a_run_copied_under_another_name_is_refused_saying_its_directory_is_not_its_run_id(tmp_path):
    """Before: "LAST ... is refused: manifest ... is mixed: it belongs to run 'r', not 'r-backup'"."""
    runs = tmp_path / "runs"
    train(runs, 1, [])
    shutil.copytree(runs / "r", runs / "r-backup")
    before = _tree(runs / "r-backup")
    with pytest.raises(ResumeError) as err:
        train(runs, 2, [], run_id=None, resume_from=runs / "r-backup")
    said = str(err.value)
    assert "is named 'r-backup', not after its run: the run in it was started with run id 'r'" in said
    assert "Resume it under its own name" in said and "resume_mode='fork'" in said and "mixed" not in said
    assert _tree(runs / "r-backup") == before
    fork = train(tmp_path / "forks", 2, [], run_id="f", resume_from=runs / "r-backup", resume_mode="fork")
    assert fork.status == "completed"  # the way out it names works
