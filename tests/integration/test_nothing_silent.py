"""A right answer or a clear error, never a "completed" run that quietly computed something else.

Scenarios found when the library was tried as a new user would: non-finite inputs and empty
loaders, configuration errors found late, a run that cannot be restarted under its own id,
unencodable callback state, what an epoch-end callback sees, the progress display, Ctrl-C.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Callback, Monitor, Scheduler, Trainer, load_result
from nnx_es.audit import audit_run
from nnx_es.errors import ConfigError, NonFiniteError, NonFiniteWarning, NoUpdateError, ResumeError
from trainkit import blobs_data, kinds, loaders, of_kind, params_of, small_net, write_blob


def _trainer(tmp_path, run_id="r", **kw):
    net = small_net()
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                   run_id=run_id, progress=False, **kw)


def _nan_loader(rows: tuple[int, ...], n: int = 48, batch_size: int = 16) -> DataLoader:
    x, y = blobs_data(n)
    x = x.clone()
    for r in rows:
        x[r, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# --- non-finite values and empty loaders ---------------------------------------------------------


def test_a_run_whose_every_update_was_skipped_does_not_end_completed(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        with pytest.raises(NoUpdateError, match="committed no optimizer update"):
            _trainer(tmp_path).fit(_nan_loader((0, 16, 32)), None, epochs=2)
    run = load_result(tmp_path / "r")
    assert run.status == "failed" and run.counters.step == 0
    assert audit_run(tmp_path / "r").ok


def test_skipped_nonfinite_updates_are_warned_about_with_their_count(tmp_path):
    with pytest.warns(NonFiniteWarning, match=r"epoch 0: 1 of 3 updates were skipped"):
        run = _trainer(tmp_path).fit(_nan_loader((16,)), None, epochs=1)
    assert run.status == "completed" and run.counters.step == 2


def test_nonfinite_raise_fails_the_run_at_the_first_nonfinite_update(tmp_path):
    with pytest.raises(NonFiniteError, match=r"epoch 0, batch 1"):
        _trainer(tmp_path, nonfinite="raise").fit(_nan_loader((16,)), None, epochs=2)
    run = load_result(tmp_path / "r")
    assert run.status == "failed" and run.last.epoch == -1  # LAST stays at the last committed epoch
    assert audit_run(tmp_path / "r").ok


def test_nonfinite_stop_commits_the_epoch_so_far_and_stops(tmp_path):
    run = _trainer(tmp_path, nonfinite="stop").fit(_nan_loader((16,)), None, epochs=3)
    assert run.status == "stopped" and len(run.history) == 1
    (stop,) = of_kind(tmp_path / "r", "stop_requested")
    assert stop.reason == "nonfinite" and "batch 1" in stop.by
    assert len(of_kind(tmp_path / "r", "microbatch_done")) == 2  # the epoch ended at the skipped update
    assert audit_run(tmp_path / "r").ok


def test_nan_validation_inputs_warn_under_skip_and_raise_under_raise(tmp_path):
    train, _ = loaders()
    with pytest.warns(NonFiniteWarning, match=r"validation metrics \['val_loss'\] are not finite"):
        _trainer(tmp_path, run_id="skip").fit(train, _nan_loader((0,), n=24), epochs=1)
    with pytest.raises(NonFiniteError, match="val_loss"):
        _trainer(tmp_path, run_id="raise", nonfinite="raise").fit(train, _nan_loader((0,), n=24), epochs=1)


@pytest.mark.parametrize("which", ["train", "val"])
def test_an_empty_loader_is_refused_before_anything_is_written(tmp_path, which):
    train, val = loaders()
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), batch_size=4)
    args = (empty, val) if which == "train" else (train, empty)
    with pytest.raises(ConfigError, match=f"{which}_loader has no batch"):
        _trainer(tmp_path).fit(*args, epochs=1)
    assert not (tmp_path / "r").exists()


def test_a_train_iterator_used_up_after_one_epoch_is_an_error_not_a_completed_run(tmp_path):
    train, _ = loaders()
    batches = iter(list(train))  # no len: found when the second epoch gets no batch
    with pytest.raises(ConfigError, match="yielded no batch in epoch 1"):
        _trainer(tmp_path).fit(batches, None, epochs=2)
    assert load_result(tmp_path / "r").status == "failed"


def test_nonfinite_must_be_a_known_policy():
    with pytest.raises(ConfigError, match="nonfinite must be one of"):
        _trainer("unused", nonfinite="ignore")


# --- configuration errors before the first batch; resume="auto" ---------------------------------


def test_a_plateau_scheduler_whose_mode_disagrees_with_the_monitor_is_refused_at_construction(tmp_path):
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min")
    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau\(mode='min'\).*'val_accuracy' has mode='max'"):
        Trainer(net, opt, nn.CrossEntropyLoss(), monitor=Monitor("val_accuracy", "max"), metrics=["accuracy"],
                schedulers=[Scheduler(plateau)], runs_root=tmp_path)


@pytest.mark.parametrize("kwargs", [dict(threshold=0.01), dict(threshold=1e-4, threshold_mode="abs"),
                                    dict(threshold=0.5, threshold_mode="abs")])
def test_a_plateau_threshold_the_monitor_would_not_apply_is_refused(tmp_path, kwargs):
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs)
    with pytest.raises(ConfigError, match=rf"threshold={kwargs['threshold']!r}.*min_delta=0.0.*Monitor\('val_loss'"):
        Trainer(net, opt, nn.CrossEntropyLoss(), monitor=Monitor("val_loss"),
                schedulers=[Scheduler(plateau)], runs_root=tmp_path)


def test_a_plateau_threshold_equal_to_the_monitors_min_delta_or_torchs_default_is_accepted(tmp_path):
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for plateau in (torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                    torch.optim.lr_scheduler.ReduceLROnPlateau(opt, threshold=0.5, threshold_mode="abs")):
        trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor=Monitor("val_loss", min_delta=0.5),
                          schedulers=[Scheduler(plateau)], runs_root=tmp_path)
        assert trainer.monitor.min_delta == 0.5


class _FailAt(Callback):
    def __init__(self, hook: str, epoch: int = 0) -> None:
        self.hook, self.epoch = hook, epoch

    def on_train_begin(self, ctx):
        if self.hook == "train_begin":
            raise RuntimeError("broken before training")

    def on_epoch_end(self, ctx):
        if self.hook == "epoch_end" and ctx.epoch == self.epoch:
            raise RuntimeError(f"broken at epoch {ctx.epoch}")


def test_resume_auto_starts_clears_or_resumes_the_run(tmp_path):
    train, val = loaders()
    # a run that failed before its first LAST blocks its id without resume="auto" ...
    with pytest.raises(RuntimeError, match="broken before training"):
        _trainer(tmp_path, callbacks=[_FailAt("train_begin")]).fit(train, val, epochs=2)
    with pytest.raises(ConfigError, match="resume='auto'"):
        _trainer(tmp_path).fit(train, val, epochs=2)
    # ... and is cleared and started afresh with it
    reference = _trainer(tmp_path, run_id="reference")
    reference.fit(*loaders(), epochs=3)
    broken = _trainer(tmp_path, callbacks=[_FailAt("epoch_end", epoch=1)])
    with pytest.raises(RuntimeError, match="broken at epoch 1"):
        broken.fit(*loaders(), epochs=3, resume="auto")
    assert [e.KIND for e in of_kind(tmp_path / "r", "run_started")] == ["run_started"]
    assert load_result(tmp_path / "r").last.epoch == 0
    # a run with a committed LAST is resumed statefully, and ends where an uninterrupted run does
    again = _trainer(tmp_path, callbacks=[_FailAt("never")])
    run = again.fit(*loaders(), epochs=3, resume="auto")
    assert run.status == "completed" and len(run.history) == 3
    assert len(of_kind(tmp_path / "r", "run_resumed")) == 1
    for k, v in params_of(reference.net).items():
        assert torch.equal(params_of(again.net)[k], v)
    assert audit_run(tmp_path / "r").ok


def test_resume_auto_never_clears_a_run_whose_last_does_not_verify(tmp_path):
    _trainer(tmp_path).fit(*loaders(), epochs=1)
    write_blob(tmp_path / "r", load_result(tmp_path / "r").last.manifest, b"")  # a torn LAST manifest
    before = kinds(tmp_path / "r")
    with pytest.raises(ResumeError):
        _trainer(tmp_path).fit(*loaders(), epochs=2, resume="auto")
    assert kinds(tmp_path / "r") == before  # nothing cleared


def test_resume_auto_needs_the_trainers_run_id(tmp_path):
    with pytest.raises(ConfigError, match="run_id"):
        _trainer(tmp_path, run_id=None).fit(*loaders(), epochs=1, resume="auto")


# --- smaller items -------------------------------------------------------------------------------


class _Unencodable(Callback):
    def state_dict(self):
        return {"count": 3, "buffer": torch.ones(2)}


def test_an_unencodable_callback_state_names_the_callback_and_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"callback '_Unencodable': state_dict\(\)\['buffer'\] \(Tensor\)"):
        _trainer(tmp_path, callbacks=[_Unencodable()]).fit(*loaders(), epochs=1)
    assert load_result(tmp_path / "r").counters.batch == 0  # refused at the opening checkpoint, before training


def test_the_epoch_summary_is_on_the_context_at_epoch_end(tmp_path):
    seen = []

    class Summary(Callback):
        def on_epoch_end(self, ctx):
            seen.append((ctx.epoch_summary.epoch, ctx.epoch_summary.microbatches, ctx.train_metrics["loss"], ctx.loss))

    run = _trainer(tmp_path, callbacks=[Summary()]).fit(*loaders(), epochs=2)
    assert [(e, m) for e, m, _, _ in seen] == [(0, 3), (1, 3)]
    assert [loss for _, _, loss, _ in seen] == [r.train["loss"] for r in run.history]  # the epoch's mean
    assert seen[0][2] != seen[0][3]  # ctx.loss stays the last microbatch's


def test_the_progress_display_shows_the_epoch_range_and_each_epochs_validation_metrics(tmp_path, capsys):
    net = small_net()
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
            run_id="p", progress=True, metrics=["accuracy"]).fit(*loaders(), epochs=2)
    err = capsys.readouterr().err
    assert "(of 0-1)" in err and "epoch 1: loss" in err and "val_accuracy" in err


class _CtrlC(Callback):
    def on_epoch_end(self, ctx):
        if ctx.epoch == 1:
            raise KeyboardInterrupt


def test_ctrl_c_records_the_run_as_interrupted_and_it_resumes(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, callbacks=[_CtrlC()]).fit(*loaders(), epochs=3)
    run = load_result(tmp_path / "r")
    assert run.status == "interrupted" and run.last.epoch == 0
    assert audit_run(tmp_path / "r").ok
    resumed = _trainer(tmp_path).fit(*loaders(), epochs=3, resume_from=tmp_path / "r")
    assert resumed.status == "completed" and len(resumed.history) == 3
    assert audit_run(tmp_path / "r").ok


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
