"""The per-batch validation callback and the final validation pass (recorded, audited clean)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnx_es import Trainer
from nnx_es.audit import audit_run
from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)


def _trainer(tmp_path, run_id, **kw) -> Trainer:
    net = small_net(1)
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.2), nn.CrossEntropyLoss(), metrics=["accuracy"],
                   runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw)


def test_the_batch_callback_sees_every_validation_batch_with_its_predictions_loss_and_counters(tmp_path):
    calls = []

    def tap(*, batch, predictions, loss, batch_count, step_count, epoch):
        calls.append((epoch, step_count, batch_count, batch[0].shape[0], predictions.detach().clone(), loss))

    trainer = _trainer(tmp_path, "tap", val_batch_callback=tap)
    train, _ = loaders(batch_size=8, n_train=48)
    _, val_full = loaders(n_val=24)
    val = torch.utils.data.DataLoader(val_full.dataset, batch_size=10)  # batches of 10, 10, 4
    run = trainer.fit(train, val, epochs=2)
    assert [(e, s, b, n) for e, s, b, n, _, _ in calls] == [
        (0, 6, 0, 10), (0, 6, 1, 10), (0, 6, 2, 4), (1, 12, 0, 10), (1, 12, 1, 10), (1, 12, 2, 4)]
    # the losses it saw are the batches' means; their row-weighted mean is the recorded val_loss
    x, y = val.dataset.tensors
    for epoch in (0, 1):
        seen = [c for c in calls if c[0] == epoch]
        rows = sum(c[3] for c in seen)
        assert sum(c[5] * c[3] for c in seen) / rows == pytest.approx(run.history[epoch].val["val_loss"], rel=1e-6)
    with torch.no_grad():
        final = trainer.net.eval()(x)
    assert torch.allclose(torch.cat([c[4] for c in calls if c[0] == 1]), final, atol=1e-6)


def test_a_batch_callback_without_the_keyword_signature_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"lacks \['step_count', 'epoch'\]"):
        _trainer(tmp_path, "bad", val_batch_callback=lambda *, batch, predictions, loss, batch_count: None)
    with pytest.raises(ConfigError, match="final_validation must be"):
        _trainer(tmp_path, "bad", final_validation="yes")
    _trainer(tmp_path, "ok", val_batch_callback=lambda **kw: None)  # **kwargs takes them all


class _StopAtUpdate(Callback):
    def on_batch_end(self, ctx):
        if ctx.epoch == 1 and ctx.batch_index == 2:
            ctx.stop_at_update()


class _Seen(Callback):
    def __init__(self):
        self.validations = []

    def on_validation_end(self, ctx, metrics):
        self.validations.append((ctx.epoch, ctx.step_count, dict(metrics)))


@pytest.mark.parametrize("mode", [True, "auto", False])
def test_final_validation_scores_the_final_weights_and_the_run_audits_clean(tmp_path, mode):
    seen = _Seen()
    trainer = _trainer(tmp_path, f"final-{mode}", final_validation=mode, callbacks=[seen])
    train, val = loaders(batch_size=8, n_train=48)
    run = trainer.fit(train, val, epochs=2)
    events = [e for _, e in read_events(run.run_dir)]
    finals = [e for e in events if e.KIND == "validation_done" and e.trigger == "final"]
    if mode is True:  # after the last epoch's commit, before finalization
        assert len(finals) == 1
        kinds = [e.KIND for e in events]
        i = kinds.index("validation_done", len(kinds) - 6)
        assert kinds[i - 1] in ("last_committed", "checkpoint_pruned") and kinds[i + 1] == "callback_finalized"
        assert kinds.index("history_appended", i - 8) < i  # after the last epoch's commit
        assert finals[0].metrics == run.history[-1].val  # the same weights the last epoch scored
        assert seen.validations[-1][2] == finals[0].metrics
    else:  # "auto": the last epoch scored these very weights already
        assert finals == []
    report = audit_run(run.run_dir)
    assert report.ok, report.violations
    assert run.status == "completed"


def test_auto_final_validation_after_a_stop_at_an_update_boundary(tmp_path):
    trainer = _trainer(tmp_path, "stop", callbacks=[_StopAtUpdate()])
    train, val = loaders(batch_size=8, n_train=48)
    run = trainer.fit(train, val, epochs=3)
    events = [e for _, e in read_events(run.run_dir)]
    finals = [e for e in events if e.KIND == "validation_done" and e.trigger == "final"]
    assert len(finals) == 1 and (finals[0].epoch, finals[0].step) == (1, 9)
    x, y = val.dataset.tensors
    with torch.no_grad():
        expected = nn.functional.cross_entropy(trainer.net.eval()(x), y).item()
    assert finals[0].metrics["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert run.status == "stopped"
    report = audit_run(run.run_dir)
    assert report.ok, report.violations
